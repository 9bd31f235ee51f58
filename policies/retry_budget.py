"""A retry budget and jittered backoff: retries may add at most ``ratio`` extra load.

Every first attempt deposits ``ratio`` (0.1: one retry per ten requests) into a balance; a
retry withdraws 1 and is refused when the balance holds less. A small time-based trickle
(``min_per_s``) lets a quiet gateway still retry now and then; the balance is capped at
``cap`` so a long calm period cannot bank a retry storm. With a steady load of R requests
per second, retries stay below ``ratio × R + min_per_s`` per second.

Pure Python with an injected clock and RNG (tests step both).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class RetryPolicy:
    max_attempts: int = 3  # attempts per request, the first included (each on another upstream)
    ratio: float = 0.1  # retries per first attempt, at most
    min_per_s: float = 0.2  # plus this trickle, so a quiet gateway can retry at all
    cap: float = 5.0  # the most retries banked
    backoff_base_s: float = 0.02  # full jitter: uniform(0, min(max, base × 2^retry))
    backoff_max_s: float = 0.5

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or not 0 <= self.ratio <= 1 or self.cap < 1:
            raise ValueError("max_attempts >= 1, 0 <= ratio <= 1 and cap >= 1")


class RetryBudget:
    def __init__(self, policy: RetryPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self.policy = policy or RetryPolicy()
        self.clock = clock
        self.rng = rng or random.Random()
        self.balance = 1.0  # one retry available from the start
        self._last = clock()
        self.retries = 0
        self.refused = 0

    def _refill(self) -> None:
        now = self.clock()
        p = self.policy
        self.balance = min(p.cap, self.balance + (now - self._last) * p.min_per_s)
        self._last = now

    def on_request(self) -> None:
        """A first attempt: deposit ``ratio``."""
        self._refill()
        self.balance = min(self.policy.cap, self.balance + self.policy.ratio)

    def try_retry(self) -> bool:
        """Spend one retry, or refuse (counted) when the budget is spent."""
        self._refill()
        if self.balance < 1.0:
            self.refused += 1
            return False
        self.balance -= 1.0
        self.retries += 1
        return True

    def backoff(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1-based), fully jittered."""
        p = self.policy
        return self.rng.uniform(0.0, min(p.backoff_max_s, p.backoff_base_s * 2 ** (retry - 1)))
