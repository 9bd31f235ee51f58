"""Per-request generation parameters, validated at the edge of the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import InvalidRequestError


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature == 0 means greedy. ``seed`` makes sampling reproducible whatever else is
    in the batch: each seeded request draws from its own generator.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_number("temperature", self.temperature, 0.0, 100.0)
        _check_number("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise InvalidRequestError("top_p must be in (0, 1]", "top_p")
        _check_int("top_k", self.top_k, minimum=-1)
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
