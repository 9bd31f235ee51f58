"""The ramp after a breaker closes (policies/breaker.py ``Ramp``), counted on a fake loop
clock: aiolimiter reads ``loop.time()``, so the loop's clock is the one stepped. Nothing
sleeps and nothing is timed: requests are offered at fixed fake instants and counted."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import TypeVar

import pytest

from policies.breaker import RAMP_STEPS, BreakerPolicy, Ramp

T = TypeVar("T")


class FakeTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only when a test moves it."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0

    def time(self) -> float:
        return self.now


def on_fake_loop(body: Callable[[FakeTimeLoop], T]) -> T:
    """Run ``body`` (synchronous code that needs a running loop) on a fresh fake-time loop."""
    loop = FakeTimeLoop()

    async def main() -> T:
        return body(loop)

    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def offered_per_step(ramp_s: float, start_rps: float, every_s: float,
                     seconds: float) -> tuple[list[int], list[int]]:
    """Offer one request each ``every_s`` for ``seconds``; count, per ramp step, the
    requests the ramp had room for (``take`` True) and those offered."""
    def body(loop: FakeTimeLoop) -> tuple[list[int], list[int]]:
        ramp = Ramp(ramp_s, start_rps)
        step_s = ramp_s / RAMP_STEPS
        steps = int(seconds / step_s)
        taken, offered = [0] * steps, [0] * steps
        began = loop.now
        for i in range(round(seconds / every_s)):
            loop.now = began + i * every_s
            k = int(i * every_s // step_s)
            offered[k] += 1
            if ramp.has_room():
                assert ramp.take()
                taken[k] += 1
            else:
                assert not ramp.take()  # no room: counted over, never waits
        return taken, offered

    return on_fake_loop(body)


def test_each_step_lets_through_its_rate_and_no_flood() -> None:
    # 10 s ramp from 2 rps: steps of 1 s at 2, 4, 8, … 1024 rps; then no limit.
    # 1000 requests offered per second (one per ms), 12 s long.
    taken, offered = offered_per_step(10.0, 2.0, 0.001, 12.0)
    assert offered == [1000] * 12
    rates = [2 * 2 ** k for k in range(RAMP_STEPS)]
    for k, rate in enumerate(rates):
        if 2 * rate < 1000:  # the limiter binds: a burst of one step's worth, then its rate
            assert rate <= taken[k] <= 2 * rate, (k, taken)
    # a burst of rate × 1 s, then the leak over the 0.999 s of offers left in the step
    assert taken[:4] == [3, 7, 15, 31]
    assert all(a < b for a, b in itertools.pairwise(taken[:9]))  # ramps up
    assert taken[10:] == [1000, 1000]  # over: unlimited
    # the first second after closing: 3 of 1000 offered (without a ramp: all 1000); the
    # first 5 s: 119 of 5000
    assert sum(taken[:5]) == 119


def test_the_ramp_ends_after_ramp_s() -> None:
    def body(loop: FakeTimeLoop) -> tuple[bool, bool, bool]:
        ramp = Ramp(5.0, 2.0)
        before = ramp.over()
        loop.now += 4.999
        during = ramp.over()
        loop.now += 0.001
        return before, during, ramp.over() and ramp.has_room() and ramp.take()

    assert on_fake_loop(body) == (False, False, True)


def test_a_ramp_needs_the_event_loop() -> None:
    with pytest.raises(RuntimeError):
        Ramp(10.0, 2.0)  # aiolimiter's clock is the running loop's


def test_policy_refuses_a_ramp_whose_first_step_lets_nothing_through() -> None:
    BreakerPolicy(ramp_s=0.0, ramp_start_rps=0.0)  # off
    BreakerPolicy(ramp_s=10.0, ramp_start_rps=1.0)  # 1 request in the first 1 s step
    with pytest.raises(ValueError):
        BreakerPolicy(ramp_s=10.0, ramp_start_rps=0.5)
    with pytest.raises(ValueError):
        BreakerPolicy(ramp_s=-1.0)
