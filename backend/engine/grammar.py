"""Constrained decoding: a request's ``GrammarSpec`` as token masks, with llguidance.

Why llguidance (docs/engine.md#choosing-the-grammar-library has the figures): of 50 JSON
Schema probes it enforced each one or refused the schema naming the keyword, where
xgrammar and outlines-core silently accepted violating output for 11 and 13; its masks
cost tens of µs per sequence at a 32k vocabulary and are computed with the GIL released;
the wheel has no dependencies.

Lifecycle of a constrained sequence (``LLMEngine`` drives it):

    check(spec)          the server, before anything is queued: checked and compiled once
                         per distinct grammar (LRU cache), or a 400 naming every keyword
                         llguidance would not enforce
    compile(spec)        the engine, at add_request when the grammar is new: in a thread
                         of its own while the request waits outside the batch (a large
                         schema never stalls the running sequences' steps)
    matcher              then: a deep copy of the compiled template (µs)
    fork                 n > 1: each choice gets a deep copy of its parent's matcher
    start(rows) → apply  every step (``grammar_masks.py``): the masks of the constrained
                         rows are computed in a worker thread while the model runs, then
                         applied to those rows of the logits as one ``masked_fill_``
    consume(token)       the sampled token (always one the mask allowed)
    drop                 finish or abort: the matcher goes with the choice's state

This module is torch-free: the server process checks grammars with it (a 400 before any
queue) without loading torch.

Invariant: a matcher only ever consumes tokens its own last mask allowed (sampling under
the mask), so it never enters llguidance's error state; a matcher is touched by one
thread at a time (the worker between ``start`` and ``apply``, the step's thread
otherwise).
"""

from __future__ import annotations

import collections
import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import llguidance

from modelfiles.tokenizer import Tokenizer

from .errors import InvalidRequestError
from .sampling import GrammarSpec

if TYPE_CHECKING:  # only in the library's stub
    from llguidance._lib import JsonCompileOptions

LLMatcher = llguidance.LLMatcher

# JSON as compact as json.dumps(separators=(",", ":")): no free whitespace for a model to
# wander in. A schema's own "x-guidance" options come after these (llguidance's order).
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}
# Forced last: unimplemented keywords come back as warnings (all of them, where strict mode
# names only the first), and any warning refuses the grammar: never a silent loosening.
JSON_OVERRIDES: JsonCompileOptions = {"lenient": True}
CACHE_SIZE = 256  # distinct compiled grammars kept
MAX_MESSAGE = 600  # characters of a refusal's message
TIMINGS_KEPT = 4096  # recent compile and mask times kept for the bench's percentiles


@dataclass(slots=True)
class GrammarStats:
    """Since start: grammars compiled, checks answered from the cache, recent timings."""

    compiles: int = 0
    cache_hits: int = 0
    compile_seconds: collections.deque[float] = field(  # check + build + first mask
        default_factory=lambda: collections.deque(maxlen=TIMINGS_KEPT))
    # per step: from the job's start (before the forward) to its masks applied
    mask_seconds: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=TIMINGS_KEPT))

    @property
    def hit_rate(self) -> float:
        total = self.compiles + self.cache_hits
        return self.cache_hits / total if total else 0.0


@dataclass(slots=True, frozen=True)
class Compiled:
    """A grammar checked and compiled: its text, and a matcher at its start state whose
    lexer and parser tables are built (each sequence gets a ``deep_copy``)."""

    text: str
    template: llguidance.LLMatcher


def _key(spec: GrammarSpec) -> bytes:
    return hashlib.sha256(f"{spec.kind}\0{spec.source}".encode()).digest()


class GrammarCompiler:
    """Grammars for one tokenizer and vocabulary: checked and compiled once each. Safe to
    call from several threads (the server checks in worker threads, the engine compiles
    in its own)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int, *,
                 cache_size: int = CACHE_SIZE,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=eos_token_id)
        self.stats = GrammarStats()
        self._cache: collections.OrderedDict[bytes, Compiled] = collections.OrderedDict()
        self._cache_size = cache_size
        self._clock = clock
        self._lock = threading.Lock()  # the cache and the stats

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, vocab_size: int,
                      eos_token_ids: tuple[int, ...] = ()) -> GrammarCompiler:
        """A compiler for a model's tokenizer (``vocab_size``: the model's, which may be
        wider than the tokenizer's; the end token: the tokenizer's first, else the
        model's)."""
        eos = tokenizer.eos_token_ids or eos_token_ids
        if not eos:
            raise InvalidRequestError("constrained decoding needs an end-of-sequence token",
                                      "response_format")
        return cls(tokenizer.backend.to_str(), vocab_size, eos[0])

    def check(self, spec: GrammarSpec) -> str:
        """The grammar text for ``spec``; ``InvalidRequestError`` naming ``spec.param``
        (and every keyword llguidance would not enforce) when it cannot be served. The
        grammar is compiled too: whatever fails there fails here."""
        return self.compile(spec).text

    def ready(self, spec: GrammarSpec) -> bool:
        """Compiled already (a ``matcher`` costs a copy)."""
        with self._lock:
            return _key(spec) in self._cache

    def matcher(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence (a copy of the compiled template)."""
        return self.compile(spec).template.deep_copy()

    def compile(self, spec: GrammarSpec) -> Compiled:
        """``spec`` compiled: from the cache (a hit), else checked and built (a compile;
        milliseconds, up to hundreds for a large schema)."""
        key = _key(spec)
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                return entry
        began = self._clock()
        text = self._validate(spec)
        try:
            template = llguidance.LLMatcher(self.tokenizer, text)
            # the first mask builds the lexer and parser tables: paid once per grammar
            template.compute_bitmask()
        except Exception as exc:  # noqa: BLE001 - the library's own errors, any class
            raise InvalidRequestError(_brief(f"invalid {spec.param}: {exc}"),
                                      spec.param) from None
        if template.is_error():  # e.g. {"$ref": "#"}: no finite output at all
            first = template.get_error().strip().splitlines()[0]
            raise InvalidRequestError(_brief(
                f"invalid {spec.param}: its grammar admits no output ({first})"), spec.param)
        entry = Compiled(text, template)
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds.append(self._clock() - began)
            self._cache[key] = entry
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return entry

    def _validate(self, spec: GrammarSpec) -> str:
        try:
            if spec.kind == "json_schema":
                text = llguidance.LLMatcher.grammar_from_json_schema(
                    spec.source, JSON_DEFAULTS, JSON_OVERRIDES)
            else:
                text = llguidance.LLMatcher.grammar_from_lark(spec.source)
        except ValueError as exc:  # not a JSON object
            raise InvalidRequestError(_brief(f"invalid {spec.param}: {exc}"),
                                      spec.param) from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            text, self.tokenizer)
        if failed:
            raise InvalidRequestError(_brief(f"invalid {spec.param}: {'; '.join(messages)}"),
                                      spec.param)
        if messages:
            raise InvalidRequestError(
                f"{spec.param} uses what constrained decoding cannot enforce (refused rather "
                f"than loosened): {'; '.join(messages)}", spec.param)
        return text


def _brief(message: str) -> str:
    """A library message cut to ``MAX_MESSAGE`` characters: a parser's error may quote
    the whole grammar, or a dump of its state."""
    return message if len(message) <= MAX_MESSAGE else message[:MAX_MESSAGE - 1] + "…"
