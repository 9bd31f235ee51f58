"""The bounded sweep, on both stores: a dead replica's backlog of expired leases (and a set
of closed ids past their forget time) drains SWEEP_LIMIT per call, and admission never
counts an expired lease or a forgotten id meanwhile.

Sizes are read from the store's own state (Redis keys; MemoryStore's dicts) between calls.
On Redis the leases expire in real time: a backlog is built with asyncio.gather well
within its TTL (a stalled host builds it again with a longer TTL).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import pytest

from policies.memory import SWEEP_LIMIT, MemoryStore
from policies.quotas import Quotas
from policies.redis_store import RedisStore
from policies.store import DuplicateRequest
from tests.policies.conftest import TOL, Harness
from tests.policies.test_contract import T, deny, grant

DEAD_TTL = 1.0   # the dead replica's leases
COST = 10        # tokens each of its reservations holds


@dataclass(frozen=True)
class Sizes:
    leases: int  # open leases, expired or not
    done: int    # closed ids the store still refuses


async def sizes(h: Harness) -> Sizes:
    if isinstance(h.store, RedisStore):
        r, keys = h.store.client, h.store.keys(T)
        leases, resv, done, starts = (await r.zcard(keys[2]), await r.hlen(keys[3]),
                                      await r.zcard(keys[4]), await r.zcard(keys[5]))
        assert leases == resv == starts  # a lease, its record and its start go together
        return Sizes(leases, done)
    assert isinstance(h.store, MemoryStore)
    t = h.store._tenants.get(T)  # the store's own state
    return Sizes(len(t.open), len(t.closed)) if t else Sizes(0, 0)


async def dead_replica(h: Harness, n: int, prefix: str = "dead") -> None:
    """`n` reservations of a replica that then dies: nobody renews or settles them. On
    Redis the leases expire in real time: a host too busy to build the backlog within
    the TTL builds it again with a longer one (never a skip)."""
    for attempt, ttl in enumerate((DEAD_TTL, 4 * DEAD_TTL, 16 * DEAD_TTL)):
        ids = [f"{prefix}{attempt}-{i:04}" for i in range(n)]
        decisions = await asyncio.gather(*(
            h.store.reserve(T, rid, COST, Quotas(), ttl) for rid in ids))
        assert all(d.granted for d in decisions)
        if (await sizes(h)).leases == n:
            await h.advance(ttl + 0.05)
            return
        # some expired (and were swept) while others came: start the tenant afresh
        assert isinstance(h.store, RedisStore)  # (the memory store's clock is the test's)
        await h.store.client.delete(*h.store.keys(T))
    raise AssertionError("the host could not build the backlog within a 16 s lease TTL")


async def test_a_backlog_drains_at_most_the_limit_per_call(harness: Harness) -> None:
    h, n = harness, 1000
    await dead_replica(h, n)
    left = n
    for i in range(math.ceil(n / SWEEP_LIMIT)):  # every kind of call sweeps, and says 0 live
        match i % 4:
            case 0:
                assert await h.store.concurrency(T) == 0
            case 1:
                assert (await h.store.usage(T))["concurrency"] == 0
            case 2:
                assert await h.store.renew(T, "unknown", 10) is False
            case _:
                assert await h.store.settle(T, "unknown", 1) is False
        left -= min(SWEEP_LIMIT, left)
        assert await sizes(h) == Sizes(left, n - left)
    assert left == 0
    u = await h.store.usage(T)
    assert (u["reserved"]["day"], u["settled"]["day"], u["concurrency"]) == (0, n * COST, 0)


async def swept_last(h: Harness, k: int) -> list[str]:
    """The `k` open leases the sweep reaches last (latest expiry, then id), last first."""
    if isinstance(h.store, RedisStore):
        ids = await h.store.client.zrange(h.store.keys(T)[2], -k, -1)
        return [bytes(i).decode() for i in reversed(ids)]
    assert isinstance(h.store, MemoryStore)
    t = h.store._tenants[T]
    return sorted(t.open, key=lambda rid: (t.open[rid].expires_us, rid))[::-1][:k]


async def test_an_expired_lease_asked_about_is_released_not_renewed(harness: Harness) -> None:
    h, n = harness, 3 * SWEEP_LIMIT
    await dead_replica(h, n)
    last = await swept_last(h, 3)
    assert await h.store.renew(T, last[0], 10) is False  # "no lease survives its TTL"
    assert await sizes(h) == Sizes(n - SWEEP_LIMIT - 1, SWEEP_LIMIT + 1)
    assert await h.store.settle(T, last[1], 1) is False  # too late: at its worst case
    assert await sizes(h) == Sizes(n - 2 * SWEEP_LIMIT - 2, 2 * SWEEP_LIMIT + 2)
    with pytest.raises(DuplicateRequest):  # expired, not swept: still reserved before
        await h.store.reserve(T, last[2], 1, Quotas(), 10)
    assert await h.store.concurrency(T) == 0
    assert await sizes(h) == Sizes(0, n)
    assert (await h.store.usage(T))["settled"]["day"] == n * COST


async def test_expired_leases_never_hold_a_slot(harness: Harness) -> None:
    h, q = harness, Quotas(max_concurrency=2)
    await dead_replica(h, 1000)
    await grant(h, "a", 1, q)
    await grant(h, "b", 1, q)
    d = await deny(h, "c", 1, q, "max_concurrency")
    # No hold estimate yet: 1 s, capped by the earliest *live* expiry (30 s away), not by
    # an expired lease's (which would say the 100 ms floor).
    assert d.retry_after_s == 1.0
    assert await h.store.concurrency(T) == 2
    assert (await h.store.usage(T))["concurrency"] == 2
    assert (await sizes(h)).leases > 2 + SWEEP_LIMIT  # the backlog is still there
    assert await h.store.settle(T, "a", 1)
    await grant(h, "c", 1, q)  # the freed slot, whatever the backlog
    while (await sizes(h)).leases > 2:
        assert await h.store.concurrency(T) == 2
    assert await h.store.renew(T, "b", 30) and await h.store.settle(T, "c", 1)


async def hold_mean_s(h: Harness) -> float:
    """The tenant's smoothed slot-hold time (lib.lua's hold_mean; MemoryStore's hold_est)."""
    if isinstance(h.store, RedisStore):
        raw = await h.store.client.hget(h.store.keys(T)[1], "hold_mean")
        assert isinstance(raw, bytes)
        return int(raw) / 1e6
    assert isinstance(h.store, MemoryStore)
    est = h.store._tenants[T].hold_est
    assert est is not None
    return est.mean_us / 1e6


async def learn_hold(h: Harness, seconds: float) -> float:
    await grant(h, "warm", 1, Quotas())
    await h.advance(seconds)
    assert await h.store.settle(T, "warm", 1)
    return await hold_mean_s(h)


async def test_the_concurrency_wait_ignores_expired_leases_age(harness: Harness) -> None:
    # A deep backlog: the oldest live lease lies past SWEEP_LIMIT expired ones in reserve
    # order, so its age is unknown (the wait is the mean), never the age of a dead lease
    # (which would say one deviation).
    h, q = harness, Quotas(max_concurrency=1)
    mean = await learn_hold(h, 1.0)
    await dead_replica(h, 1000)
    await grant(h, "a", 1, q)
    d = await deny(h, "c", 1, q, "max_concurrency")
    assert d.retry_after_s == pytest.approx(mean, abs=1e-6)


async def test_the_concurrency_wait_finds_the_oldest_live_lease(harness: Harness) -> None:
    # 2 sweeps + 30: at the refusal 30 expired leases precede the live one in reserve order.
    h, q = harness, Quotas(max_concurrency=1)
    mean = await learn_hold(h, 1.0)
    await dead_replica(h, 2 * SWEEP_LIMIT + 30)
    await grant(h, "a", 1, q)
    await h.advance(0.3)
    d = await deny(h, "c", 1, q, "max_concurrency")
    assert (await sizes(h)).leases == 31
    assert d.retry_after_s is not None
    if h.exact:
        assert d.retry_after_s == pytest.approx(mean - 0.3, abs=1e-6)
    else:  # a's age is at least 0.3 s (more if the host stalled)
        assert d.retry_after_s <= mean - 0.3 + TOL


async def forgotten_ids(h: Harness, n: int) -> None:
    """`n` closed ids past their forget time, none swept yet."""
    if isinstance(h.store, RedisStore):  # a day cannot pass on Redis: write them as due
        r, keys = h.store.client, h.store.keys(T)
        sec, usec = await r.time()
        past = sec * 1_000_000 + usec - 1_000_000
        await r.zadd(keys[4], {f"gone{i:04}": past - n + i for i in range(n)})
    else:
        for i in range(n):
            await grant(h, f"gone{i:04}", 1, Quotas(), ttl=1.0)
            assert await h.store.settle(T, f"gone{i:04}", 1)
        await h.advance(1.0 + 86400)  # forgotten a day after the lease's end
    assert await sizes(h) == Sizes(0, n)


async def test_forgotten_ids_drain_at_most_the_limit_per_call(harness: Harness) -> None:
    h, n = harness, 500
    await forgotten_ids(h, n)
    assert await h.store.concurrency(T) == 0
    assert await sizes(h) == Sizes(0, n - SWEEP_LIMIT)
    # Due but not swept yet (the newest: swept last) is forgotten all the same.
    await grant(h, f"gone{n - 1:04}", 1, Quotas())
    assert await sizes(h) == Sizes(1, n - 2 * SWEEP_LIMIT)
    assert await h.store.settle(T, f"gone{n - 1:04}", 1)  # closed again: refused again
    with pytest.raises(DuplicateRequest):
        await h.store.reserve(T, f"gone{n - 1:04}", 1, Quotas(), 10)
    while (await sizes(h)).done > 1:
        before = (await sizes(h)).done
        assert await h.store.concurrency(T) == 0
        assert before - (await sizes(h)).done == min(SWEEP_LIMIT, before - 1)
