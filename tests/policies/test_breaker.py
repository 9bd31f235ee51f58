"""The circuit breaker and the retry budget, on a fake clock."""

from __future__ import annotations

import random

import pytest

from policies.breaker import Breaker, BreakerPolicy, Pass
from policies.retry_budget import RetryBudget, RetryPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fail(b: Breaker, n: int = 1) -> None:
    for _ in range(n):
        granted = b.try_pass()
        assert granted is not None
        b.record(granted, "failure")


def test_consecutive_failures_open_then_cooldown_probe_closes() -> None:
    clock = Clock()
    moves: list[tuple[str, str]] = []
    b = Breaker(BreakerPolicy(consecutive_failures=3, cooldown_s=5.0, max_probes=1), clock,
                lambda old, new: moves.append((old, new)))
    fail(b, 2)
    b.record(b.try_pass() or Pass(False), "success")  # a success resets the run
    fail(b, 2)
    assert b.state == "closed"
    fail(b)
    assert b.state == "open" and b.try_pass() is None
    assert b.remaining_cooldown() == pytest.approx(5.0)
    clock.now += 4.9
    assert not b.available()
    clock.now += 0.2
    probe = b.try_pass()
    assert probe is not None and probe.probe and b.state == "half_open"
    assert b.try_pass() is None  # one probe at a time
    b.record(probe, "success")
    assert b.state == "closed"
    assert moves == [("closed", "open"), ("open", "half_open"), ("half_open", "closed")]
    assert b.transitions == {"closed": 1, "open": 1, "half_open": 1}


def test_a_failed_probe_reopens_for_a_fresh_cooldown() -> None:
    clock = Clock()
    b = Breaker(BreakerPolicy(consecutive_failures=1, cooldown_s=2.0, max_probes=2), clock)
    fail(b)
    clock.now += 2.0
    p1, p2 = b.try_pass(), b.try_pass()
    assert p1 is not None and p2 is not None and b.try_pass() is None
    b.record(p1, "failure")
    assert b.state == "open" and b.remaining_cooldown() == pytest.approx(2.0)
    b.record(p2, "success")  # a probe judged after the breaker reopened changes nothing
    assert b.state == "open"


def test_neutral_outcomes_free_the_probe_and_never_count() -> None:
    clock = Clock()
    b = Breaker(BreakerPolicy(consecutive_failures=2, cooldown_s=1.0), clock)
    for _ in range(10):
        granted = b.try_pass()
        assert granted is not None
        b.record(granted, "neutral")  # 4xx, client gone
    assert b.state == "closed" and b.failures == 0
    fail(b, 2)
    clock.now += 1.0
    probe = b.try_pass()
    assert probe is not None
    b.record(probe, "neutral")
    assert b.state == "half_open" and b.try_pass() is not None


def test_failure_rate_over_the_window_opens() -> None:
    clock = Clock()
    b = Breaker(BreakerPolicy(consecutive_failures=100, failure_rate=0.5, window_s=10.0,
                              min_requests=10), clock)
    for i in range(9):  # alternate: never 100 in a row, but half fail
        granted = b.try_pass()
        assert granted is not None
        b.record(granted, "failure" if i % 2 else "success")
        clock.now += 0.1
    assert b.state == "closed"  # under min_requests
    fail(b)
    assert b.state == "open"


def test_old_outcomes_leave_the_window() -> None:
    clock = Clock()
    b = Breaker(BreakerPolicy(consecutive_failures=100, failure_rate=0.5, window_s=1.0,
                              min_requests=4), clock)
    fail(b, 3)
    clock.now += 5.0  # those failures are history
    for _ in range(3):
        granted = b.try_pass()
        assert granted is not None
        b.record(granted, "success")
    granted = b.try_pass()
    assert granted is not None
    b.record(granted, "failure")
    assert b.state == "closed"


def test_retry_budget_caps_retries_at_the_ratio() -> None:
    clock = Clock()
    budget = RetryBudget(RetryPolicy(ratio=0.1, min_per_s=0.0, cap=5.0), clock,
                         random.Random(1))
    assert budget.try_retry()  # one in hand at start
    granted = 0
    for _ in range(1000):
        budget.on_request()
        granted += budget.try_retry()
    assert 95 <= granted <= 100 and budget.refused > 800
    assert budget.retries == granted + 1


def test_retry_budget_trickles_and_caps_when_quiet() -> None:
    clock = Clock()
    budget = RetryBudget(RetryPolicy(ratio=0.1, min_per_s=1.0, cap=3.0), clock)
    assert budget.try_retry() and not budget.try_retry()
    clock.now += 1000.0
    assert [budget.try_retry() for _ in range(4)] == [True, True, True, False]


def test_backoff_is_jittered_and_bounded() -> None:
    budget = RetryBudget(RetryPolicy(backoff_base_s=0.1, backoff_max_s=0.3),
                         rng=random.Random(7))
    waits = [budget.backoff(n) for n in (1, 2, 3, 4, 5) for _ in range(50)]
    assert all(0 <= w <= 0.3 for w in waits) and len(set(waits)) > 200
    assert max(budget.backoff(1) for _ in range(200)) <= 0.1
