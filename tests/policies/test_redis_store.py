"""RedisStore beyond the shared contract: round trips, keys, outages, cancellation."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.crc import key_slot

from policies.quotas import Quotas
from policies.redis_store import RedisStore
from policies.store import DuplicateRequest, StoreUnavailable
from tests.policies.conftest import RedisServer

Q = Quotas(tokens_per_minute=6000, requests_per_minute=60, tokens_per_day=100_000,
           tokens_per_month=1_000_000, max_concurrency=10)


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
async def store(redis_server: RedisServer, request: pytest.FixtureRequest
                ) -> AsyncIterator[RedisStore]:
    s = RedisStore(redis_server.url, key_prefix=f"x{uuid.uuid4().int % 10**12}")
    yield s
    await s.close()


@pytest.fixture
def lonely_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of the test's own, to stop, pause and restart."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


async def test_one_round_trip_per_decision(store: RedisStore,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # Warm up: the connection's handshake, and each script's first NOSCRIPT + SCRIPT LOAD.
    assert (await store.reserve("alpha", "r0", 100, Q, 30)).granted
    assert await store.renew("alpha", "r0", 30) and await store.settle("alpha", "r0", 50)
    sent: list[str] = []
    original = AbstractConnection.send_packed_command

    async def counting(self: AbstractConnection, command: Any, check_health: bool = True) -> None:
        sent.append(bytes(command[0] if isinstance(command, list) else command)[:30].decode())
        await original(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counting)
    assert (await store.reserve("alpha", "r1", 100, Q, 30)).granted
    assert await store.renew("alpha", "r1", 30)
    assert await store.settle("alpha", "r1", 50)
    assert len(sent) == 3 and all("EVALSHA" in c for c in sent), sent
    # the renewal beat: a tenant's leases, however many, in one round trip
    for i in range(2, 40):
        assert (await store.reserve("alpha", f"r{i}", 1, Quotas(), 30)).granted
    sent.clear()
    ids = [f"r{i}" for i in range(1, 40)]
    assert await store.renew_many("alpha", ids + ["gone"], 30) == \
        [False] + [True] * 38 + [False]  # r1 is settled
    assert len(sent) == 1 and "EVALSHA" in sent[0], sent


async def test_scripts_reload_after_script_flush(store: RedisStore, raw: Redis) -> None:
    assert (await store.reserve("alpha", "r1", 1, Q, 30)).granted
    await raw.script_flush()  # e.g. a restarted or failed-over server: NOSCRIPT
    assert (await store.reserve("alpha", "r2", 1, Q, 30)).granted
    assert await store.settle("alpha", "r2", 1)


async def test_keys_are_hash_tagged_one_slot_and_expire(store: RedisStore, raw: Redis) -> None:
    assert (await store.reserve("alpha", "r1", 100, Q, 30)).granted
    assert (await store.reserve("alpha", "r2", 100, Q, 30)).granted
    assert await store.settle("alpha", "r1", 10)
    assert not (await store.reserve("alpha", "r3", 10**6, Q, 30)).granted
    keys = sorted([k async for k in raw.scan_iter(store.keys("alpha")[0].rsplit(":", 1)[0] + ":*")])
    assert keys == sorted(store.keys("alpha"))
    assert all(re.fullmatch(r"x\d+:\{alpha\}:(bucket|budget|leases|resv|done|starts)", k)
               for k in keys)
    assert len({key_slot(k.encode()) for k in keys}) == 1
    ttl = {k.rsplit(":", 1)[1]: await raw.pttl(k) for k in keys}
    assert all(v > 0 for v in ttl.values()), ttl
    assert ttl["bucket"] <= (60 + 60) * 1000          # gone a minute after it is full again
    assert 86_400_000 - 5000 < ttl["done"] <= 86_400_000 + 31_000  # lease end + 1 day
    assert 39 * 86_400_000 < ttl["budget"] <= 40 * 86_400_000


async def test_time_is_redis_time_not_the_client_clock(
        store: RedisStore, raw: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "time", lambda: 946_684_800.0)  # the client thinks it is Y2K
    assert (await store.reserve("alpha", "r1", 10, Quotas(tokens_per_day=10), 30)).granted
    d = await store.reserve("alpha", "r2", 1, Quotas(tokens_per_day=10), 30)
    sec, usec = await raw.time()
    now = int(sec) + int(usec) / 1e6
    assert d.retry_after_s is not None
    assert abs(d.retry_after_s - ((int(now) // 86400 + 1) * 86400 - now)) < 1.0


async def test_redis_down_is_unavailable_fast_and_recovers(lonely_redis: RedisServer) -> None:
    store = RedisStore(lonely_redis.url, timeout_s=0.25)
    try:
        assert (await store.reserve("alpha", "r1", 10, Q, 30)).granted
        lonely_redis.stop()
        for call in (store.reserve("alpha", "r2", 10, Q, 30), store.settle("alpha", "r1", 5),
                     store.renew("alpha", "r1", 30), store.usage("alpha"),
                     store.concurrency("alpha"), store.ping()):
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await call
            assert time.monotonic() - t0 < 1.0  # a bound, not a performance target
        lonely_redis.start()  # same port, empty (no persistence)
        await store.ping()
        assert (await store.reserve("alpha", "r3", 10, Q, 30)).granted
        assert await store.concurrency("alpha") == 1
    finally:
        await store.close()


async def test_hung_redis_times_out_and_recovers(lonely_redis: RedisServer) -> None:
    store = RedisStore(lonely_redis.url, timeout_s=0.25)
    try:
        await store.ping()
        lonely_redis.pause()  # accepts bytes, answers nothing
        try:
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await store.reserve("alpha", "r1", 10, Q, 30)
            assert 0.2 < time.monotonic() - t0 < 1.0
        finally:
            lonely_redis.resume()
        assert (await store.reserve("alpha", "r2", 10, Q, 30)).granted
    finally:
        await store.close()


async def test_cancel_mid_reserve_leaves_the_pool_sane(lonely_redis: RedisServer) -> None:
    store = RedisStore(lonely_redis.url, timeout_s=1.0, max_connections=1)
    try:
        await store.ping()
        lonely_redis.pause()
        try:
            task = asyncio.create_task(store.reserve("alpha", "r1", 10, Q, 30))
            await asyncio.sleep(0.1)  # the script is sent, its reply is not read
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            lonely_redis.resume()
        # The one pooled connection must not hand r1's late reply to the next call.
        assert (await store.reserve("alpha", "r2", 10, Q, 30)).granted
        assert await store.concurrency("alpha") in (1, 2)  # r1 ran if Redis read it
        assert (await store.usage("alpha"))["reserved"]["day"] in (10, 20)
        with pytest.raises(DuplicateRequest):
            await store.reserve("alpha", "r2", 10, Q, 30)
    finally:
        await store.close()


async def test_a_new_day_prunes_old_period_counters(store: RedisStore, raw: Redis) -> None:
    assert (await store.reserve("alpha", "r1", 10, Q, 30)).granted
    budget = store.keys("alpha")[1]
    today = await raw.hget(budget, "day")
    month = today[:6]
    # Plant counters of long-gone periods, and pretend the last reserve was on another day.
    await raw.hset(budget, mapping={"d:20000101:r": 5, "d:20000101:x:max_concurrency": 1,
                                    "m:200001:u": 7, "day": "20000101"})
    assert (await store.reserve("alpha", "r2", 10, Q, 30)).granted
    fields = await raw.hgetall(budget)
    assert fields["day"] == today
    assert not [f for f in fields if "2000" in f]
    assert (fields[f"d:{today}:r"], fields[f"m:{month}:r"]) == ("20", "20")
