"""The engine's side of constrained decoding (``grammar.py`` has the lifecycle):
``Constraints`` holds the requests whose grammar compiles and counts the live matchers;
``Masker`` computes a step's masks in a worker thread while the model runs, and
``MaskJob.apply`` puts them on the constrained rows of the logits as one
``masked_fill_``."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
import torch

from .errors import InvalidRequestError
from .grammar import Compiled, GrammarCompiler, GrammarStats
from .sampling import GrammarSpec
from .sequence import Sequence

# A step with nothing to run but requests whose grammar compiles waits this long for one
# (then steps again: the loop also takes new requests and aborts between steps).
COMPILE_WAIT_S = 0.005


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
        """[len(matchers), vocab] bool, True where a token is not allowed.

        No torch op runs here: a torch op on this thread gives the process an OpenMP team
        of its own, more threads than CPUs, and then libgomp stops spinning at barriers:
        the forward's (~9 a layer) sleep instead, and every later forward ran ~1.8x slower,
        constrained or not (measured: docs/bench.md#structured-outputs-issue-24-2026-12-02). llguidance (its pointer
        API, as its torch helper calls it, without importing that module: it pulls in
        torch._dynamo) and numpy are single-threaded here."""
        n = len(matchers)
        words = (self.vocab_size + 31) // 32
        bitmask = np.full((n, words), -1, dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], bitmask.ctypes.data, words * 4, n)
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(allowed[:, :self.vocab_size] == 0)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class Constraints:
    """An engine's constrained requests: those waiting for their grammar to compile (in a
    thread of their own, outside the batch), their choices' matchers (made, forked,
    counted: ``live``, 0 lets a step skip the grammar work entirely), and each step's mask
    job."""

    def __init__(self, grammars: GrammarCompiler | None, vocab_size: int) -> None:
        self.grammars = grammars
        self.vocab_size = vocab_size
        self.live = 0
        # request id -> (its first sequence, its grammar compiling)
        self.pending: dict[str, tuple[Sequence, Future[Compiled]]] = {}
        self._masker: Masker | None = None  # made at the first constrained step
        self._compiler: ThreadPoolExecutor | None = None  # made at the first new grammar

    def defer(self, seq: Sequence) -> bool:
        """True when ``seq``'s grammar is new: it compiles in the background and the
        request waits in ``pending`` (``compiled`` hands it back)."""
        spec = seq.params.grammar
        if spec is None:
            return False
        if self.grammars is None:
            raise InvalidRequestError("this engine serves no constrained decoding",
                                      spec.param)
        if self.grammars.ready(spec):
            return False
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(1, thread_name_prefix="sluice-grammar-compile")
        self.pending[seq.request_id] = (seq, self._compiler.submit(self.grammars.compile,
                                                                   spec))
        return True

    def compiled(self, wait: bool) -> list[tuple[Sequence, Compiled | InvalidRequestError]]:
        """The pending requests whose grammar is compiled, or refused; ``wait``: the step
        has nothing else to do, so block until one is (at most ``COMPILE_WAIT_S``)."""
        if wait:
            futures.wait([f for _, f in self.pending.values()], timeout=COMPILE_WAIT_S,
                         return_when=futures.FIRST_COMPLETED)
        out: list[tuple[Sequence, Compiled | InvalidRequestError]] = []
        for rid, (seq, future) in list(self.pending.items()):
            if future.done():
                del self.pending[rid]
                try:
                    out.append((seq, future.result()))
                except InvalidRequestError as exc:
                    out.append((seq, exc))
                except Exception as exc:  # noqa: BLE001 - refuse the request, not the loop
                    param = seq.params.grammar.param if seq.params.grammar else "grammar"
                    out.append((seq, InvalidRequestError(
                        f"cannot compile the grammar: {type(exc).__name__}", param)))
        return out

    def drop(self, request_id: str) -> Sequence | None:
        """Forget a pending request (aborted); its first sequence, or None."""
        entry = self.pending.pop(request_id, None)
        return None if entry is None else entry[0]

    def matcher(self, spec: GrammarSpec,
                source: llguidance.LLMatcher | None = None) -> llguidance.LLMatcher:
        """A new choice's matcher: a copy of ``source`` (a parent's, or a compiled
        template), else of the compiled grammar's (compiled now if it is not)."""
        if source is not None:
            matcher = source.deep_copy()
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
        if not work or self.grammars is None:
            return None
        if self._masker is None:
            self._masker = Masker(self.vocab_size, self.grammars.stats)
        return self._masker.start(work, wants_raw)

    def close(self) -> None:
        """Stop the worker threads (the engine is done)."""
        if self._masker is not None:
            self._masker.close()
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)
            self._compiler = None

    @property
    def compiles(self) -> int:
        return 0 if self.grammars is None else self.grammars.stats.compiles

    @property
    def cache_hits(self) -> int:
        return 0 if self.grammars is None else self.grammars.stats.cache_hits
