"""The slot-hold estimator (policies/hold.py): the pure core, its Lua mirror, and the wait a
``max_concurrency`` refusal carries, on the fake clock (exact) and on Redis (bounded)."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import AsyncIterator

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio import Redis

from policies import hold
from policies.hold import COLD_WAIT_US, MIN_WAIT_US, HoldEstimate, observe, wait_us
from policies.quotas import Quotas
from policies.redis_store import lua_source
from tests.policies.conftest import TOL, Harness, RedisServer

T = "alpha"
Q = Quotas(max_concurrency=1)
US = 1_000_000

# ---- the pure core -----------------------------------------------------------------------


def test_the_first_sample_is_the_mean_and_half_of_it_the_deviation() -> None:
    assert observe(None, 1_800_000) == HoldEstimate(1_800_000, 900_000)
    assert observe(None, -5) == HoldEstimate(0, 0)  # a clock step back is not a negative hold


def test_later_samples_move_the_mean_by_an_eighth_and_the_deviation_by_a_quarter() -> None:
    est = observe(HoldEstimate(1_000_000, 200_000), 1_800_000)  # err +800 ms
    assert est == HoldEstimate(1_100_000, 350_000)
    est = observe(est, 300_000)  # err -800 ms: floor division, as Lua's math.floor
    assert est == HoldEstimate(1_000_000, 462_500)


def test_the_wait_is_the_oldest_requests_predicted_end() -> None:
    est = HoldEstimate(1_800_000, 200_000)
    assert wait_us(est, 300_000, 30 * US) == 1_500_000   # mean − age
    assert wait_us(est, 1_700_000, 30 * US) == 200_000   # near its end: one deviation
    assert wait_us(est, 9 * US, 30 * US) == 200_000      # overdue: one deviation, never 0
    assert wait_us(est, 0, 700_000) == 700_000           # the lease bound caps it
    assert wait_us(HoldEstimate(10_000, 1_000), 0, 30 * US) == MIN_WAIT_US  # the floor
    assert wait_us(est, 0, 5) == MIN_WAIT_US             # even under an expiring lease
    assert wait_us(None, 0, 30 * US) == COLD_WAIT_US     # no history: poll each second
    assert wait_us(None, 0, 400_000) == 400_000


@given(st.lists(st.integers(0, 10**9), min_size=1, max_size=50))
def test_the_mean_stays_within_the_samples_and_the_deviation_non_negative(
        samples: list[int]) -> None:
    est = None
    for s in samples:
        est = observe(est, s)
        assert min(samples) <= est.mean_us <= max(samples)
        assert est.dev_us >= 0


@given(st.integers(0, 10**9), st.integers(0, 10**9))
def test_a_steady_tenant_is_learned(first: int, steady: int) -> None:
    est = observe(None, first)
    for _ in range(250):
        est = observe(est, steady)
    assert abs(est.mean_us - steady) < 8 and est.dev_us < 8  # within the integer rounding


@given(st.one_of(st.none(), st.builds(HoldEstimate, st.integers(0, 10**9),
                                      st.integers(0, 10**9))),
       st.integers(0, 10**9), st.integers(0, 10**9), st.integers(1, 10**9))
def test_the_wait_is_positive_bounded_and_shrinks_with_age(
        est: HoldEstimate | None, age: int, more: int, bound: int) -> None:
    w = wait_us(est, age, bound)
    assert MIN_WAIT_US <= w <= max(bound, MIN_WAIT_US)
    assert wait_us(est, age + more, bound) <= w


# ---- lib.lua mirrors it exactly ----------------------------------------------------------

# ARGV: ops, each 'o' held | 'w' age bound; returns mean, dev after each 'o', wait after 'w'.
PROBE = lua_source("lib") + """
local out, i = {}, 1
while i <= #ARGV do
  if ARGV[i] == 'o' then
    observe_hold(tonumber(ARGV[i + 1]))
    local st = redis.call('HMGET', K_BUDGET, 'hold_mean', 'hold_dev')
    out[#out + 1] = {tonumber(st[1]), tonumber(st[2])}
    i = i + 2
  else
    out[#out + 1] = hold_wait(tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]))
    i = i + 3
  end
end
return out
"""


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def test_lua_mirrors_the_python_estimator(raw: Redis) -> None:
    probe = raw.register_script(PROBE)
    rng = random.Random(20250314)
    for _ in range(20):
        keys = [f"h{uuid.uuid4().hex[:12]}:{{{T}}}:{k}"
                for k in ("bucket", "budget", "leases", "resv", "done", "starts")]
        args: list[str | int] = []
        expected: list[object] = []
        est: HoldEstimate | None = None
        for _ in range(60):
            if rng.random() < 0.5:
                held = rng.choice([rng.randrange(-1000, 10**6), rng.randrange(0, 10**11)])
                est = observe(est, held)
                args += ["o", held]
                expected.append([est.mean_us, est.dev_us])
            else:
                age, bound = rng.randrange(0, 10**10), rng.randrange(1, 10**8)
                args += ["w", age, bound]
                expected.append(wait_us(est, age, bound))
        assert await probe(keys=keys, args=args) == expected
        await raw.delete(*keys)


# ---- through the store, on the fake clock: exact -----------------------------------------


async def test_the_refusal_wait_is_learned_from_settled_requests(memory: Harness) -> None:
    h = memory
    s = h.store
    assert (await s.reserve(T, "r1", 10, Q, 30)).granted
    cold = await s.reserve(T, "r2", 10, Q, 30)
    assert (cold.denied_by, cold.retry_after_s) == ("max_concurrency", 1.0)  # no history
    await h.advance(1.8)
    assert await s.settle(T, "r1", 7)  # held 1.8 s: mean 1.8, dev 0.9
    assert (await s.reserve(T, "r3", 10, Q, 30)).granted
    await h.advance(0.3)
    d = await s.reserve(T, "r4", 10, Q, 30)
    assert (d.denied_by, d.retry_after_s) == ("max_concurrency", pytest.approx(1.5))
    await h.advance(1.2)  # r3 is 1.5 s old: due in 0.3 s, but the estimate's error is 0.9 s
    assert (await s.reserve(T, "r5", 10, Q, 30)).retry_after_s == pytest.approx(0.9)
    await h.advance(5.0)  # overdue: within one deviation still, never "now"
    assert (await s.reserve(T, "r6", 10, Q, 30)).retry_after_s == pytest.approx(0.9)
    assert await s.settle(T, "r3", 9)  # held 6.5 s: mean 1.8 + 4.7/8, dev 0.9 + (4.7 − 0.9)/4
    assert (await s.reserve(T, "r7", 10, Q, 30)).granted
    d = await s.reserve(T, "r8", 10, Q, 30)
    assert d.retry_after_s == pytest.approx(1.8 + 4.7 / 8)


async def test_settles_at_zero_teach_nothing(memory: Harness) -> None:
    h, s = memory, memory.store
    assert (await s.reserve(T, "r1", 10, Q, 30)).granted
    await h.advance(2.0)
    assert await s.settle(T, "r1", 5)
    assert (await s.reserve(T, "r2", 10, Q, 30)).granted
    await h.advance(0.01)
    assert await s.settle(T, "r2", 0)  # refused by the queue, or undone: it never ran
    assert (await s.reserve(T, "r3", 10, Q, 30)).granted
    assert (await s.reserve(T, "r4", 10, Q, 30)).retry_after_s == pytest.approx(2.0)


async def test_the_lease_expiry_bounds_the_wait_and_the_floor_keeps_it_positive(
        memory: Harness) -> None:
    h, s = memory, memory.store
    q = Quotas(max_concurrency=2)
    assert (await s.reserve(T, "r1", 10, q, 30)).granted
    await h.advance(20.0)
    assert await s.settle(T, "r1", 5)  # the tenant's requests take 20 s
    assert (await s.reserve(T, "r2", 10, q, 30)).granted  # the oldest: due in 20 s
    assert (await s.reserve(T, "r3", 10, q, 4.0)).granted  # a lease that expires in 4 s
    assert (await s.reserve(T, "r4", 10, q, 30)).retry_after_s == pytest.approx(4.0)
    await h.advance(3.95)  # 50 ms left on that lease: the floor, not 50 ms
    assert (await s.reserve(T, "r5", 10, q, 30)).retry_after_s == pytest.approx(0.1)
    await h.advance(0.06)  # it expired: a slot is free now
    assert (await s.reserve(T, "r6", 10, q, 30)).granted


# ---- the same contract on Redis, whose clock keeps running -------------------------------


async def test_both_stores_predict_the_wait_from_the_oldest_lease(harness: Harness) -> None:
    h, s = harness, harness.store
    t0 = time.monotonic()
    assert (await s.reserve(T, "r1", 10, Q, 30)).granted
    await h.advance(0.4)
    assert await s.settle(T, "r1", 5)
    held_max = time.monotonic() - t0 + (0 if h.exact else TOL)  # ≥ 0.4 (fake: exactly)
    t1 = time.monotonic()
    assert (await s.reserve(T, "r2", 10, Q, 30)).granted
    await h.advance(0.1)
    d = await s.reserve(T, "r3", 10, Q, 30)
    age_max = time.monotonic() - t1 + (0 if h.exact else TOL)  # ≥ 0.1
    assert d.denied_by == "max_concurrency" and d.retry_after_s is not None
    if h.exact:
        assert d.retry_after_s == pytest.approx(0.3)
    else:  # max(mean − age, mean / 2) with mean in [0.4, held_max], age in [0.1, age_max]
        assert max(0.4 - age_max, 0.2) - TOL <= d.retry_after_s <= held_max - 0.1 + TOL
    assert d.retry_after_s >= hold.MIN_WAIT_US / US
