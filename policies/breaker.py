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

``Ramp`` paces a member right after half-open → closed: without it, least-load routing sends
a recovered member (zero in flight) every new request until its load matches the others'.
For ``ramp_s`` its dispatch rate is held by aiolimiter's ``AsyncLimiter``, one per step of
``ramp_s / RAMP_STEPS``, the rate doubling each step from ``ramp_start_rps``; then no limit.
A step's limiter starts empty, so step k lets through at most 2 × rate_k × step seconds (a
burst of one step's worth, then its rate): docs/resilience.md#ramp-after-a-breaker-closes.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from aiolimiter import AsyncLimiter

State = Literal["closed", "open", "half_open"]
Outcome = Literal["success", "failure", "neutral"]
STATE_VALUE: dict[State, int] = {"closed": 0, "half_open": 1, "open": 2}
RAMP_STEPS = 10  # a ramp's rate doubles this many times (steps of ramp_s / RAMP_STEPS)


@dataclass(slots=True, frozen=True)
class BreakerPolicy:
    consecutive_failures: int = 5  # this many failures in a row open the breaker
    failure_rate: float = 0.5  # … or this share of failures over the window
    window_s: float = 10.0
    min_requests: int = 20  # the rate applies only past this many outcomes in the window
    cooldown_s: float = 5.0  # open this long before a probe is let through
    max_probes: int = 1  # requests let through at once while half-open
    ramp_s: float = 10.0  # after half-open → closed, dispatch is paced this long (0: off)
    ramp_start_rps: float = 2.0  # the paced rate at first, doubling each ramp step

    def __post_init__(self) -> None:
        if self.consecutive_failures < 1 or self.max_probes < 1 or self.min_requests < 1:
            raise ValueError("consecutive_failures, max_probes and min_requests must be >= 1")
        if not 0 < self.failure_rate <= 1 or self.window_s <= 0 or self.cooldown_s < 0:
            raise ValueError("failure_rate in (0, 1], window_s > 0, cooldown_s >= 0")
        if self.ramp_s < 0 or (self.ramp_s > 0
                               and self.ramp_start_rps * self.ramp_s / RAMP_STEPS < 1):
            raise ValueError("ramp_s >= 0, and ramp_start_rps × ramp_s / RAMP_STEPS >= 1 "
                             "(a first step lets one request through)")


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


class Ramp:
    """Paced dispatch to a member whose breaker just closed (see the module docstring).

    On the event loop's clock, as aiolimiter is (it reads ``loop.time()``): build it inside
    the loop. ``take`` never waits: routing asks it while choosing a member, and a member
    without room comes after the others (``gateway/pool.py``)."""

    __slots__ = ("_limiter", "_loop", "_step", "began", "start_rps", "step_s")

    def __init__(self, ramp_s: float, start_rps: float) -> None:
        self._loop = asyncio.get_running_loop()
        self.began = self._loop.time()
        self.step_s = ramp_s / RAMP_STEPS
        self.start_rps = start_rps
        self._step = -1
        self._limiter: AsyncLimiter | None = None

    def rate(self, step: int) -> float:
        """Requests per second let through during ``step``."""
        return self.start_rps * float(2 ** step)

    def limiter(self) -> AsyncLimiter | None:
        """This step's limiter; None once the ramp is over."""
        step = int((self._loop.time() - self.began) // self.step_s)
        if step >= RAMP_STEPS:
            self._limiter = None
            return None
        if step != self._step:  # AsyncLimiter's rate is fixed at construction
            self._step = step
            self._limiter = AsyncLimiter(self.rate(step) * self.step_s, self.step_s)
        return self._limiter

    def over(self) -> bool:
        return self.limiter() is None

    def has_room(self) -> bool:
        """Whether one more request may go now (always, once the ramp is over)."""
        lim = self.limiter()
        return lim is None or lim.has_capacity()

    def take(self) -> bool:
        """Count one request dispatched; False when it goes over the ramp's rate (no other
        member could take it). Once the ramp is over, every request is within it."""
        lim = self.limiter()
        return lim is None or _take_now(lim)


def _take_now(limiter: AsyncLimiter) -> bool:
    """One unit of ``limiter`` if it has one now, without waiting. ``acquire`` suspends only
    while ``has_capacity()`` is False, and nothing runs between the check and the call (one
    thread, no await), so a single step of the coroutine completes it."""
    if not limiter.has_capacity():
        return False
    step = limiter.acquire()
    try:
        step.send(None)
    except StopIteration:
        return True
    step.close()  # unreachable right after has_capacity(); were it reached: not counted
    return False
