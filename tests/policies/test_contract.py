"""The Store contract, one suite run against MemoryStore (fake clock) and RedisStore.

Waits are checked exactly on the fake clock; on Redis, whose clock keeps running, they are
checked against the same expectation less the real time that passed (`expect_wait`).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from datetime import UTC, datetime

import pytest

from policies.quotas import Decision, Quotas, RateHeaders
from policies.store import DuplicateRequest, Store, StoreError, StoreUnavailable
from tests.policies.conftest import TOL, Harness

T = "alpha"
TTL = 30.0


async def grant(h: Harness, rid: str, tokens: int, q: Quotas, ttl: float = TTL) -> Decision:
    d = await h.store.reserve(T, rid, tokens, q, ttl)
    assert d.granted, d
    assert d.denied_by is None and d.retry_after_s is None
    return d


async def deny(h: Harness, rid: str, tokens: int, q: Quotas, by: str) -> Decision:
    d = await h.store.reserve(T, rid, tokens, q, TTL)
    assert not d.granted and d.denied_by == by, d
    return d


async def test_tokens_per_minute_grant_then_deny(harness: Harness) -> None:
    h, q = harness, Quotas(tokens_per_minute=6000)  # refills 100 tokens/s
    t0 = time.monotonic()
    d = await grant(h, "r1", 6000, q)
    assert (d.rate.limit_tokens, d.rate.remaining_tokens) == (6000, 0)
    h.expect_wait(d.rate.reset_tokens_s, 60.0, time.monotonic() - t0)
    d = await deny(h, "r2", 50, q, "tokens_per_minute")
    # The wait is the deficit over the rate, from the store's own reported level.
    rem, wait = d.rate.remaining_tokens, d.retry_after_s
    assert rem is not None and wait is not None
    assert (50 - rem - 1) / 100 - TOL <= wait <= (50 - rem) / 100 + TOL
    h.expect_wait(wait, 0.5, time.monotonic() - t0)
    await h.advance(wait)
    await grant(h, "r3", 50, q)
    never = await deny(h, "r4", 6001, q, "tokens_per_minute")  # more than the capacity
    assert never.retry_after_s is None


async def test_requests_per_minute_grant_then_deny(harness: Harness) -> None:
    h, q = harness, Quotas(requests_per_minute=3)  # refills one request per 20 s
    t0 = time.monotonic()
    for i, left in enumerate((2, 1, 0)):
        d = await grant(h, f"r{i}", 1, q)
        assert (d.rate.limit_requests, d.rate.remaining_requests) == (3, left)
        assert d.rate.limit_tokens is None and d.rate.remaining_tokens is None
    d = await deny(h, "r3", 1, q, "requests_per_minute")
    h.expect_wait(d.retry_after_s, 20.0, time.monotonic() - t0)
    h.expect_wait(d.rate.reset_requests_s, 60.0, time.monotonic() - t0)
    never = await h.store.reserve(T, "r4", 1, Quotas(requests_per_minute=0), TTL)
    assert never == Decision(False, "requests_per_minute", None, RateHeaders(0, 0, 0.0))


async def test_tokens_per_day_grant_then_deny(harness: Harness) -> None:
    h, q = harness, Quotas(tokens_per_day=1000)
    await grant(h, "r1", 600, q)
    d = await deny(h, "r2", 500, q, "tokens_per_day")
    now = await h.server_time()
    midnight = (math.floor(now) // 86400 + 1) * 86400
    if h.exact:
        assert d.retry_after_s == pytest.approx(12 * 3600)  # the fake clock says noon
    assert d.retry_after_s is not None and 0 < d.retry_after_s <= 86400
    assert abs(d.retry_after_s - (midnight - now)) < 1.0  # consistent with the store's clock
    await grant(h, "r3", 400, q)  # exactly up to the budget
    assert (await deny(h, "r4", 1001, q, "tokens_per_day")).retry_after_s is None


async def test_tokens_per_month_grant_then_deny(harness: Harness) -> None:
    h, q = harness, Quotas(tokens_per_month=1000)
    if h.clock is not None:
        h.clock.now = float(datetime(2024, 2, 29, 12, tzinfo=UTC).timestamp())  # leap day
    await grant(h, "r1", 999, q)
    d = await deny(h, "r2", 2, q, "tokens_per_month")
    now = datetime.fromtimestamp(await h.server_time(), UTC)
    first = datetime(now.year + now.month // 12, now.month % 12 + 1, 1, tzinfo=UTC)
    if h.exact:
        assert d.retry_after_s == 12 * 3600
    assert d.retry_after_s is not None and 0 < d.retry_after_s <= 31 * 86400
    assert abs(d.retry_after_s - (first - now).total_seconds()) < 1.0
    assert (await deny(h, "r3", 1001, q, "tokens_per_month")).retry_after_s is None


async def test_max_concurrency_grant_then_deny(harness: Harness) -> None:
    h, q = harness, Quotas(max_concurrency=2)
    t0 = time.monotonic()
    await grant(h, "r1", 1, q, ttl=1.0)
    await h.advance(0.2)
    await grant(h, "r2", 1, q, ttl=1.0)
    d = await deny(h, "r3", 1, q, "max_concurrency")
    h.expect_wait(d.retry_after_s, 0.8, time.monotonic() - t0 - 0.2)  # r1's lease expiry
    assert await h.store.concurrency(T) == 2
    assert await h.store.settle(T, "r1", 1)
    await grant(h, "r4", 1, q)
    zero = await h.store.reserve(T, "r5", 1, Quotas(max_concurrency=0), TTL)
    assert (zero.denied_by, zero.retry_after_s) == ("max_concurrency", None)


async def test_denial_takes_nothing(harness: Harness) -> None:
    h = harness
    q = Quotas(tokens_per_minute=600, requests_per_minute=600, tokens_per_day=550,
               tokens_per_month=5000, max_concurrency=2)  # both buckets refill 10/s
    t0 = time.monotonic()
    g = await grant(h, "r1", 500, q)
    before = await h.store.usage(T)
    denials = [await deny(h, "r2", 60, q, "tokens_per_day"),   # the buckets would allow it
               await deny(h, "r3", 101, q, "tokens_per_day")]  # tpm too: day binds (longer)
    await grant(h, "r4", 1, q)
    denials.append(await deny(h, "r5", 1, q, "max_concurrency"))
    after = await h.store.usage(T)
    drift = 0 if h.exact else math.ceil(10 * (time.monotonic() - t0)) + 1  # real refill
    for d in denials[:2]:
        for took, now in ((g.rate.remaining_tokens, d.rate.remaining_tokens),
                          (g.rate.remaining_requests, d.rate.remaining_requests)):
            assert took is not None and now is not None
            assert took <= now <= took + drift
    assert before["rejects"] == {}
    assert after["rejects"] == {"tokens_per_day": 2, "max_concurrency": 1}
    assert after["reserved"]["day"] == before["reserved"]["day"] + 1  # r4 only
    assert after["reserved"]["month"] == before["reserved"]["month"] + 1
    assert after["requests"]["day"] == before["requests"]["day"] + 1
    assert after["concurrency"] == 2
    if h.exact:
        assert denials[2].rate.remaining_tokens == 99 and denials[2].rate.remaining_requests == 598


async def test_binding_limit_is_named(harness: Harness) -> None:
    h = harness
    q = Quotas(tokens_per_minute=6000, tokens_per_day=6000)
    await grant(h, "r1", 100, q)
    d = await h.store.reserve(T, "r2", 5950, q, TTL)  # tpm: ~0.5 s; day: until midnight
    now = await h.server_time()
    if (math.floor(now) // 86400 + 1) * 86400 - now > 2:  # else tpm's wait is the longer
        assert (d.denied_by, d.retry_after_s is not None) == ("tokens_per_day", True)
    # The day denies with a wait, the TPM bucket can never hold 7001: never binds.
    d = await deny(h, "r3", 7001, Quotas(tokens_per_minute=6000, tokens_per_day=7100),
                   "tokens_per_minute")
    assert d.retry_after_s is None


async def test_rate_headers_go_down_and_come_back(harness: Harness) -> None:
    h, q = harness, Quotas(tokens_per_minute=600, requests_per_minute=60)  # 10 tokens/s
    t0 = time.monotonic()
    d1 = await grant(h, "r1", 200, q)
    d2 = await grant(h, "r2", 200, q)
    assert await h.store.settle(T, "r1", 50)  # refunds 150
    d3 = await grant(h, "r3", 0, q)
    drift = math.ceil(10 * (time.monotonic() - t0)) + 1
    assert [d.rate.remaining_requests for d in (d1, d2, d3)] == [59, 58, 57]
    for d, expected in ((d1, 400), (d2, 200), (d3, 350)):
        assert d.rate.remaining_tokens is not None
        assert expected <= d.rate.remaining_tokens <= expected + (0 if h.exact else drift)
    assert d2.rate.reset_tokens_s is not None and d3.rate.reset_tokens_s is not None
    assert d3.rate.reset_tokens_s < d2.rate.reset_tokens_s
    minute = (await h.store.usage(T))["reserved"]["minute"]  # drawn from the TPM bucket
    assert 250 - (0 if h.exact else drift) <= minute <= 250
    headers = dict(d3.rate.as_headers())
    assert headers[b"x-ratelimit-limit-tokens"] == b"600"
    assert headers[b"x-ratelimit-remaining-requests"] == b"57"
    assert headers[b"x-ratelimit-reset-requests"].endswith(b"s")


async def test_settle_is_idempotent(harness: Harness) -> None:
    h, q = harness, Quotas(tokens_per_minute=6000, tokens_per_day=10_000)
    await grant(h, "r1", 1000, q)
    assert await h.store.settle(T, "r1", 400)
    first = await h.store.usage(T)
    assert await h.store.settle(T, "r1", 400) is False
    assert await h.store.settle(T, "r1", 0) is False
    assert await h.store.settle(T, "never-reserved", 5) is False
    assert await h.store.settle("nobody", "r1", 5) is False
    again = await h.store.usage(T)
    for u in (first, again):  # reserved["minute"] refills on Redis: compare the rest
        u["reserved"].pop("minute", None)
    assert again == first
    assert (again["reserved"]["day"], again["settled"]["day"], again["concurrency"]) == (0, 400, 0)


async def test_actual_below_reserved_refunds_and_above_charges_extra(harness: Harness) -> None:
    h, q = harness, Quotas(tokens_per_minute=6000, tokens_per_day=10_000)  # 100 tokens/s
    t0 = time.monotonic()
    await grant(h, "r1", 1000, q)
    assert await h.store.settle(T, "r1", 300)  # refund 700
    await grant(h, "r2", 100, q)
    assert await h.store.settle(T, "r2", 400)  # under-reported bound: 300 more charged
    d = await grant(h, "r3", 0, q)
    drift = math.ceil(100 * (time.monotonic() - t0)) + 1
    assert d.rate.remaining_tokens is not None
    assert 6000 - 700 <= d.rate.remaining_tokens <= 6000 - 700 + (0 if h.exact else drift)
    u = await h.store.usage(T)
    assert (u["reserved"]["day"], u["settled"]["day"], u["settled"]["month"]) == (0, 700, 700)


async def test_expired_lease_is_released_at_worst_case(harness: Harness) -> None:
    h, q = harness, Quotas(tokens_per_minute=6000, max_concurrency=1)
    await grant(h, "r1", 500, q, ttl=0.3)
    await grant(h, "r2", 10, Quotas(), ttl=0.3)
    assert await h.store.concurrency(T) == 2
    await h.advance(0.35)
    u = await h.store.usage(T)  # usage alone releases the dead replica's work
    assert (u["reserved"]["day"], u["settled"]["day"], u["concurrency"]) == (0, 510, 0)
    assert await h.store.concurrency(T) == 0
    assert await h.store.settle(T, "r1", 1) is False  # too late: charged at worst case
    assert await h.store.renew(T, "r2", 10) is False
    with pytest.raises(DuplicateRequest):
        await h.store.reserve(T, "r1", 1, q, TTL)
    await grant(h, "r3", 1, q)  # the lease is free again
    assert (await h.store.usage(T))["settled"]["day"] == 510


async def test_renew_many_renews_each_live_lease_in_one_call(harness: Harness) -> None:
    h, q = harness, Quotas(max_concurrency=3)
    for rid in ("r1", "r2", "r3"):
        await grant(h, rid, 10, q, ttl=0.4)
    assert await h.store.settle(T, "r2", 5)
    assert await h.store.renew_many(T, [], 1.0) == []
    await h.advance(0.25)
    assert await h.store.renew_many(T, ["r1", "r2", "unknown", "r3"], 0.4) == \
        [True, False, False, True]
    await h.advance(0.25)  # past the original expiry: both renewed leases are live
    assert await h.store.concurrency(T) == 2
    await h.advance(0.3)  # past the renewed one: released at worst case, not renewed
    assert await h.store.renew_many(T, ["r1", "r3"], 1.0) == [False, False]
    u = await h.store.usage(T)
    assert (u["settled"]["day"], u["concurrency"]) == (25, 0)


async def test_renew_keeps_a_lease_alive(harness: Harness) -> None:
    h, q = harness, Quotas(max_concurrency=1)
    await grant(h, "r1", 100, q, ttl=0.4)
    await h.advance(0.25)
    assert await h.store.renew(T, "r1", 0.4)
    await h.advance(0.25)  # past the original expiry
    assert await h.store.concurrency(T) == 1
    await deny(h, "r2", 1, q, "max_concurrency")
    assert await h.store.renew(T, "unknown", 1.0) is False
    assert await h.store.settle(T, "r1", 80)
    assert await h.store.renew(T, "r1", 1.0) is False
    u = await h.store.usage(T)
    assert (u["settled"]["day"], u["concurrency"]) == (80, 0)


async def test_reserving_a_request_id_twice_is_refused(harness: Harness) -> None:
    h, q = harness, Quotas(tokens_per_minute=6000)
    await grant(h, "r1", 100, q)
    with pytest.raises(DuplicateRequest) as info:
        await h.store.reserve(T, "r1", 100, q, TTL)
    assert isinstance(info.value, StoreError) and not isinstance(info.value, StoreUnavailable)
    u = await h.store.usage(T)
    assert (u["reserved"]["day"], u["requests"]["day"], u["concurrency"]) == (100, 1, 1)
    assert await h.store.settle(T, "r1", 100)
    with pytest.raises(DuplicateRequest):
        await h.store.reserve(T, "r1", 100, q, TTL)
    assert (await h.store.reserve("beta", "r1", 1, q, TTL)).granted  # ids are per tenant


async def test_bad_arguments_are_refused(harness: Harness) -> None:
    h = harness
    assert isinstance(h.store, Store)
    for call in (h.store.reserve(T, "r", -1, Quotas(), TTL),
                 h.store.reserve(T, "r", 1, Quotas(), 0),
                 h.store.reserve("a{b}", "r", 1, Quotas(), TTL),
                 h.store.settle(T, "r", -5)):
        with pytest.raises(ValueError):
            await call


async def test_concurrent_reserves_never_overspend_the_bucket(harness: Harness) -> None:
    h, q = harness, Quotas(tokens_per_minute=10_000)
    rng = random.Random(7)
    costs = [rng.randint(1, 100) for _ in range(300)]  # ~15k wanted, 10k available
    stores = [h.store]
    if h.replica is not None:  # three replicas, three pools, one Redis
        stores += [await h.replica(), await h.replica()]
    t0 = time.monotonic()
    decisions = await asyncio.gather(*(
        stores[i % len(stores)].reserve(T, f"r{i}", cost, q, TTL) for i, cost in enumerate(costs)))
    elapsed = time.monotonic() - t0
    refill = 0.0 if h.exact else 10_000 / 60 * elapsed
    granted = sum(c for c, d in zip(costs, decisions, strict=True) if d.granted)
    assert all(d.denied_by in (None, "tokens_per_minute") for d in decisions)
    assert not all(d.granted for d in decisions)
    assert granted <= 10_000 + refill
    assert granted > 10_000 - 100  # a denial means < its cost (<= 100) was left
    u = await h.store.usage(T)
    assert u["reserved"]["day"] == granted
    assert u["concurrency"] == u["requests"]["day"] == sum(d.granted for d in decisions)


async def test_concurrent_reserves_never_exceed_max_concurrency(harness: Harness) -> None:
    h, q = harness, Quotas(max_concurrency=5)
    stores = [h.store] + ([await h.replica(), await h.replica()] if h.replica else [])
    decisions = await asyncio.gather(*(
        stores[i % len(stores)].reserve(T, f"r{i}", 1, q, TTL) for i in range(60)))
    assert sum(d.granted for d in decisions) == 5
    assert await h.store.concurrency(T) == 5
