"""A step's grammar masks: computed in a worker thread while the model runs, applied to
the constrained rows of the logits as one ``masked_fill_`` (``grammar.py`` has the
lifecycle)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

from .errors import InvalidRequestError
from .grammar import GrammarCompiler, GrammarStats
from .sampling import GrammarSpec


class MaskJob:
    """The masks of one step's constrained rows, computed in a worker thread."""

    def __init__(self, rows: list[int], future: Future[torch.Tensor],
                 stats: GrammarStats, clock: Callable[[], float], began: float,
                 wants_raw: bool = False) -> None:
        self.rows = rows
        self.wants_raw = wants_raw  # a constrained row reports logprobs (of the raw logits)
        self._future = future
        self._stats = stats
        self._clock = clock
        self._began = began

    @torch.inference_mode()  # the runner's logits are inference tensors
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ([rows, vocab]) with every token the grammars forbid at -inf, in
        place: one ``masked_fill_`` over the constrained rows."""
        forbidden = self._future.result()
        vocab = logits.shape[1]
        if forbidden.shape[1] != vocab:  # a wider head than the tokenizer's vocabulary
            pad = torch.ones(forbidden.shape[0], vocab, dtype=torch.bool)
            width = min(vocab, forbidden.shape[1])
            pad[:, :width] = forbidden[:, :width]
            forbidden = pad
        if len(self.rows) == logits.shape[0]:
            logits.masked_fill_(forbidden, float("-inf"))
        else:
            idx = torch.tensor(self.rows, dtype=torch.long)
            logits.index_copy_(0, idx, logits.index_select(0, idx)
                               .masked_fill_(forbidden, float("-inf")))
        self._stats.mask_seconds.append(self._clock() - self._began)
        return logits


class Masker:
    """Computes a step's masks beside the forward pass (llguidance releases the GIL)."""

    def __init__(self, vocab_size: int, stats: GrammarStats, *, threads: int | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.vocab_size = vocab_size
        self.stats = stats
        self._clock = clock
        n = threads or max(1, min(4, (os.cpu_count() or 2) // 2))
        self._executor = llguidance.LLExecutor(num_threads=n)
        self._pool: ThreadPoolExecutor | None = None  # started at the first constrained step
        self._bits = torch.arange(32, dtype=torch.int32)

    def start(self, work: list[tuple[llguidance.LLMatcher, int]],
              wants_raw: bool = False) -> MaskJob:
        """Begin the masks of ``work`` ((matcher, logits row) pairs, rows distinct)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="sluice-grammar")
        matchers = [m for m, _ in work]
        future = self._pool.submit(self._forbidden, matchers)
        return MaskJob([r for _, r in work], future, self.stats, self._clock, self._clock(),
                       wants_raw)

    def _forbidden(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        """[len(matchers), vocab] bool, True where a token is not allowed."""
        # llguidance's pointer API, as its torch helper calls it (without importing that
        # module, which pulls in torch._dynamo for a compiled kernel we do not use)
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), words * 4,
            len(matchers))
        allowed = (bitmask.unsqueeze(-1) >> self._bits) & 1  # [n, words, 32]
        return (allowed == 0).reshape(len(matchers), -1)[:, :self.vocab_size]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class Constraints:
    """An engine's constrained choices: their matchers (made, forked, counted) and each
    step's mask job. ``live`` is the number of matchers held: 0 lets a step skip the
    grammar work entirely."""

    def __init__(self, grammars: GrammarCompiler | None, vocab_size: int) -> None:
        self.grammars = grammars
        self._masker = None if grammars is None else Masker(vocab_size, grammars.stats)
        self.live = 0

    def matcher(self, spec: GrammarSpec,
                parent: llguidance.LLMatcher | None = None) -> llguidance.LLMatcher:
        """A new choice's matcher: a copy of ``parent``'s (a fork), else a fresh one."""
        if parent is not None:
            matcher = parent.deep_copy()
        elif self.grammars is None:
            raise InvalidRequestError("this engine serves no constrained decoding",
                                      spec.param)
        else:
            matcher = self.grammars.matcher(spec)
        self.live += 1
        return matcher

    def release(self, count: int = 1) -> None:
        """``count`` matchers were dropped with their choices (finish, abort)."""
        self.live -= count

    def start(self, work: list[tuple[llguidance.LLMatcher, int]],
              wants_raw: bool) -> MaskJob | None:
        if not work or self._masker is None:
            return None
        return self._masker.start(work, wants_raw)

    @property
    def compiles(self) -> int:
        return 0 if self.grammars is None else self.grammars.stats.compiles

    @property
    def cache_hits(self) -> int:
        return 0 if self.grammars is None else self.grammars.stats.cache_hits

