"""A circuit breaker for one upstream: stop sending to a server that keeps failing.

    closed ──(N consecutive failures, or failure rate ≥ r over the rolling window)──▶ open
    open ──(cooldown elapsed; the next pass)──▶ half_open
    half_open ──(a probe succeeds)──▶ closed
    half_open ──(a probe fails)──▶ open (a fresh cooldown)

What counts: the caller records ``success``, ``failure`` (connect error, 5xx, first-byte
timeout, the upstream breaking off) or ``neutral`` (a 4xx, a client that left: they say
nothing about the upstream's health). In half-open at most ``max_probes`` requests are let
through at once; each must be recorded exactly once, which frees its probe place.

Pure Python with an injected monotonic clock, so tests step time instead of sleeping. One
breaker lives in one gateway process: replicas each learn an upstream's health on their
own (a dead upstream fails fast everywhere, so sharing would save only a few requests).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

State = Literal["closed", "open", "half_open"]
Outcome = Literal["success", "failure", "neutral"]
STATE_VALUE: dict[State, int] = {"closed": 0, "half_open": 1, "open": 2}


@dataclass(slots=True, frozen=True)
class BreakerPolicy:
    consecutive_failures: int = 5  # this many failures in a row open the breaker
    failure_rate: float = 0.5  # … or this share of failures over the window
    window_s: float = 10.0
    min_requests: int = 20  # the rate applies only past this many outcomes in the window
    cooldown_s: float = 5.0  # open this long before a probe is let through
    max_probes: int = 1  # requests let through at once while half-open

    def __post_init__(self) -> None:
        if self.consecutive_failures < 1 or self.max_probes < 1 or self.min_requests < 1:
            raise ValueError("consecutive_failures, max_probes and min_requests must be >= 1")
        if not 0 < self.failure_rate <= 1 or self.window_s <= 0 or self.cooldown_s < 0:
            raise ValueError("failure_rate in (0, 1], window_s > 0, cooldown_s >= 0")


@dataclass(slots=True, frozen=True)
class Pass:
    """Permission for one request; ``probe`` marks a half-open trial."""

    probe: bool


class Breaker:
    def __init__(self, policy: BreakerPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_transition: Callable[[State, State], None] | None = None) -> None:
        self.policy = policy or BreakerPolicy()
        self.clock = clock
        self.on_transition = on_transition
        self._state: State = "closed"
        self.opened_at = 0.0
        self.consecutive = 0
        self.probes = 0  # probes in flight
        self._window: collections.deque[tuple[float, bool]] = collections.deque()
        self._failures_in_window = 0
        self.transitions: dict[State, int] = {"closed": 0, "open": 0, "half_open": 0}
        self.failures = 0
        self.successes = 0

    # ---- reading --------------------------------------------------------------------------
    @property
    def state(self) -> State:
        """The state now (an open breaker past its cooldown reads as half-open)."""
        if self._state == "open" and self.remaining_cooldown() == 0.0:
            self._move("half_open")
        return self._state

    def remaining_cooldown(self) -> float:
        """Seconds until an open breaker lets a probe through (0 when not open)."""
        if self._state != "open":
            return 0.0
        return max(0.0, self.opened_at + self.policy.cooldown_s - self.clock())

    def available(self) -> bool:
        """Whether ``try_pass`` would let a request through now (no side effect but the
        open → half-open move once the cooldown is over)."""
        state = self.state
        return state == "closed" or (state == "half_open"
                                     and self.probes < self.policy.max_probes)

    # ---- using ----------------------------------------------------------------------------
    def try_pass(self) -> Pass | None:
        """Let one request through, or None (open, or every probe place taken)."""
        state = self.state
        if state == "closed":
            return Pass(probe=False)
        if state == "half_open" and self.probes < self.policy.max_probes:
            self.probes += 1
            return Pass(probe=True)
        return None

    def record(self, granted: Pass, outcome: Outcome) -> None:
        """The result of a request ``try_pass`` let through (exactly once per pass)."""
        if granted.probe:
            self.probes = max(0, self.probes - 1)
        if outcome == "neutral":
            return
        failed = outcome == "failure"
        if failed:
            self.failures += 1
        else:
            self.successes += 1
        if granted.probe and self._state == "half_open":
            self._reset_counts()
            self._open() if failed else self._move("closed")
            return
        if self._state != "closed":
            return  # a request let through before the breaker opened: already judged
        now = self.clock()
        self._push(now, failed)
        self.consecutive = self.consecutive + 1 if failed else 0
        p = self.policy
        if self.consecutive >= p.consecutive_failures or failed and len(self._window) >= p.min_requests \
                and self._failures_in_window >= p.failure_rate * len(self._window):
            self._open()

    # ---- internals ------------------------------------------------------------------------
    def _push(self, now: float, failed: bool) -> None:
        w = self._window
        w.append((now, failed))
        self._failures_in_window += failed
        horizon = now - self.policy.window_s
        while w and w[0][0] < horizon:
            _, old = w.popleft()
            self._failures_in_window -= old

    def _reset_counts(self) -> None:
        self.consecutive = 0
        self._window.clear()
        self._failures_in_window = 0

    def _open(self) -> None:
        self.opened_at = self.clock()
        self._reset_counts()
        self._move("open")

    def _move(self, to: State) -> None:
        if to == self._state and to != "open":
            return
        old, self._state = self._state, to
        self.transitions[to] += 1
        if self.on_transition is not None:
            self.on_transition(old, to)
