"""The capacity gate's Redis keys outlive their slots: a renewal keeps them, so an upstream
held full past the acquire's key TTL (refusals only, no grant since) never loses them."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from policies.capacity import RedisGate
from tests.policies.conftest import RedisServer

TTL_S = 5.0  # a slot's own TTL; the keys are kept this + 60 s


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[Redis]:
    r = Redis.from_url(redis_server.url)
    yield r
    await r.aclose()


async def test_a_renewal_keeps_the_keys_of_a_full_upstream(client: Redis) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    gate = RedisGate(client, key_prefix=prefix)
    keys = [f"{prefix}:{{up:m}}:slots", f"{prefix}:{{up:m}}:tokens"]
    assert await gate.acquire("m", "a", 10, cap_tokens=None, cap_seqs=1, ttl_s=60)
    # time passes with the upstream full: only refusals, which leave the keys' TTL be
    for key in keys:
        await client.pexpire(key, 200)
    assert not await gate.acquire("m", "b", 10, cap_tokens=None, cap_seqs=1, ttl_s=TTL_S)
    assert all(0 < ttl <= 200 for ttl in [await client.pttl(k) for k in keys])
    # (were the renewal to leave them, both would be gone 0.2 s from here, the slot too)
    # the holder's renewal gives the keys their minute back ...
    assert await gate.renew_many("m", ["a"], TTL_S) == [True]
    assert all(ttl > 60_000 for ttl in [await client.pttl(k) for k in keys])
    # ... so the slot is still counted, and the upstream still full, past the old expiry
    await asyncio.sleep(0.3)
    assert await gate.in_flight("m") == (1, 10)
    assert not await gate.acquire("m", "b", 10, cap_tokens=None, cap_seqs=1, ttl_s=TTL_S)
    # a renewal that finds nothing keeps nothing alive
    await gate.release("m", "a")
    assert await gate.renew_many("m", ["a"], TTL_S) == [False]
