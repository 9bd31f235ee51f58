"""Per-request generation parameters, validated at the edge of the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .errors import InvalidRequestError

MAX_LOGPROBS = 20  # top logprobs per token, at most (OpenAI's chat limit)
MAX_N = 128  # choices per request, at most (OpenAI's limit)
# A temperature below this is greedy (vLLM's threshold too): dividing float32 logits by a
# smaller one overflows to inf, and the softmax of infs is NaN (a fuzzed ``temperature:
# 5e-324`` made ``multinomial`` raise inside the engine's step and took the server down).
GREEDY_BELOW = 1e-5


@dataclass(slots=True, frozen=True)
class GrammarSpec:
    """A constraint on a request's output (structured outputs, tool calls): the tokens it
    may sample are those the grammar allows (``grammar.py`` compiles it).

    ``kind``: ``json_schema`` (``source`` is a JSON Schema, as JSON text) or ``lark`` (a
    Lark grammar in llguidance's dialect, where ``%json{...}`` embeds a JSON Schema).
    ``param``: the request field a refusal names (``response_format``, ``tools``).
    """

    kind: Literal["json_schema", "lark"]
    source: str
    param: str = "response_format"

    def __post_init__(self) -> None:
        if self.kind not in ("json_schema", "lark"):
            raise InvalidRequestError(f"unknown grammar kind {self.kind!r}", self.param)
        if not isinstance(self.source, str) or not self.source:
            raise InvalidRequestError("the grammar must be a non-empty string", self.param)


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature below ``GREEDY_BELOW`` (1e-5), 0 included, means greedy. ``top_k``,
    ``top_p`` and ``min_p`` (vLLM's: drop tokens less likely than ``min_p`` times the
    likeliest) narrow the random picks. ``seed`` makes sampling reproducible whatever else
    is in the batch: each seeded request draws from its own generator. ``presence_penalty``
    and ``frequency_penalty`` (OpenAI's, over the output tokens) and ``logit_bias``
    ((token id, bias) pairs, ids unique) change the logits before greedy or random picks.
    ``logprobs``: report each output token's logprob and this many top ones (None: none).
    ``n``: how many choices to generate from one prefill of the prompt.
    ``speculative``: False opts the request out of speculative decoding.
    ``grammar``: constrain the output to a grammar (``GrammarSpec``; None: free text).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0  # keep tokens at least this fraction of the likeliest one's (0: off)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    n: int = 1
    speculative: bool = True  # may be drafted for, where the engine speculates (spec.py)
    grammar: GrammarSpec | None = None  # constrained decoding (grammar.py)
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_number("temperature", self.temperature, 0.0, 100.0)
        _check_number("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise InvalidRequestError("top_p must be in (0, 1]", "top_p")
        _check_int("top_k", self.top_k, minimum=-1)
        _check_number("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=-(2**63))
        if not isinstance(self.stop, tuple) or not all(
            isinstance(s, str) and s for s in self.stop
        ):
            raise InvalidRequestError("stop must be non-empty strings", "stop")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                   for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative ints",
                                      "stop_token_ids")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos must be a boolean", "ignore_eos")
        if not isinstance(self.speculative, bool):
            raise InvalidRequestError("speculative must be a boolean", "speculative")
        if self.grammar is not None:
            if not isinstance(self.grammar, GrammarSpec):
                raise InvalidRequestError("grammar must be a GrammarSpec", "response_format")
            if self.ignore_eos:  # a finished grammar allows nothing but the end
                raise InvalidRequestError("ignore_eos cannot be combined with "
                                          f"{self.grammar.param}", "ignore_eos")
        _check_int("n", self.n, minimum=1)
        if self.n > MAX_N:
            raise InvalidRequestError(f"n must be at most {MAX_N}", "n")
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_logit_bias(self.logit_bias)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
            if self.logprobs > MAX_LOGPROBS:
                raise InvalidRequestError(f"logprobs must be at most {MAX_LOGPROBS}",
                                          "logprobs")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Presence or frequency penalties apply (the sampler needs the output tokens)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _check_logit_bias(pairs: object) -> None:
    if not isinstance(pairs, tuple):
        raise InvalidRequestError("logit_bias must be (token id, bias) pairs", "logit_bias")
    seen: set[int] = set()
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise InvalidRequestError("logit_bias must be (token id, bias) pairs",
                                      "logit_bias")
        token, bias = pair
        _check_int("logit_bias", token, minimum=0)
        _check_number("logit_bias", bias, -100.0, 100.0)
        if token in seen:
            raise InvalidRequestError(f"logit_bias names token {token} twice", "logit_bias")
        seen.add(token)


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be an integer, got {type(value).__name__}", name)
    if value < minimum:
        raise InvalidRequestError(f"{name} must be >= {minimum}, got {value}", name)


def _check_number(name: str, value: object, lo: float, hi: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a number, got {type(value).__name__}", name)
    if not lo <= float(value) <= hi:
        raise InvalidRequestError(f"{name} must be in [{lo}, {hi}], got {value}", name)
