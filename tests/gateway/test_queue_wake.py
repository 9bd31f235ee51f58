"""Two replicas' dispatch queues on one real redis-server: a release on replica A wakes the
waiter on replica B by the release event, a lost event or a killed subscriber falls back to
polling the gate, and the gateway's wiring starts and stops its subscriber cleanly.

Which cause woke B's pump is counted (``DispatchQueue.wakeups``); with the fallback poll
set to a minute, a waiter granted within the test's deadline was woken by the event. No
assertion measures time."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

import gateway.queue as queue_mod
from gateway.cli import demo_tenants
from gateway.config import load_gateway_config
from gateway.queue import DispatchQueue, SlotRequest, hear_releases
from policies.capacity import RedisGate
from policies.release_events import ReleaseEvents
from tests.policies.conftest import RedisServer, eventually

DEADLINE_S = 10.0


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


class CountingGate:
    """A replica's gate, counting its acquire calls (to know B's pump has asked)."""

    def __init__(self, gate: RedisGate) -> None:
        self.gate, self.acquires = gate, 0

    async def acquire(self, upstream: str, request_id: str, tokens: int,
                      cap_tokens: int | None, cap_seqs: int | None, ttl_s: float) -> bool:
        self.acquires += 1
        return await self.gate.acquire(upstream, request_id, tokens, cap_tokens, cap_seqs,
                                       ttl_s)

    async def release(self, upstream: str, request_id: str) -> bool:
        return await self.gate.release(upstream, request_id)

    async def renew(self, upstream: str, request_id: str, ttl_s: float) -> bool:
        return await self.gate.renew(upstream, request_id, ttl_s)

    async def renew_many(self, upstream: str, request_ids: Sequence[str],
                         ttl_s: float) -> list[bool]:
        return await self.gate.renew_many(upstream, request_ids, ttl_s)

    async def in_flight(self, upstream: str) -> tuple[int, int]:
        return await self.gate.in_flight(upstream)


@dataclass
class Replicas:
    prefix: str
    admin: Redis  # replica A's client (and the test's)
    a: RedisGate  # replica A holds the upstream's one slot through its gate
    b_client: Redis
    b_gate: CountingGate
    b: DispatchQueue  # replica B's queue for the same upstream

    def waiter(self, rid: str = "b1") -> asyncio.Task[float]:
        req = SlotRequest(rid, "t", 1.0, 4, 1, None, None)

        async def wait() -> float:
            slot = await self.b.take(req)
            slot.release()
            return slot.waited_s

        return asyncio.ensure_future(wait())

    async def queued(self) -> None:
        """B's waiter is queued and B's pump has asked the gate (and was refused) once."""
        await eventually(lambda: self.b.size == 1 and self.b_gate.acquires >= 2,
                         "B's waiter queued and its pump refused")


@asynccontextmanager
async def listening(r: Replicas, **opts: Any) -> AsyncIterator[ReleaseEvents]:
    """B hears the releases (``hear_releases``), subscribed before the block runs."""
    events = hear_releases({"m": r.b}, r.b_gate.gate, **opts)
    assert events is not None
    events.start()
    try:
        await eventually(r.b.hears_releases, "B subscribed")
        yield events
    finally:
        await events.aclose()


@pytest.fixture
async def replicas(redis_server: RedisServer) -> AsyncIterator[Replicas]:
    prefix = f"w{uuid.uuid4().hex[:8]}"
    admin, b_client = Redis.from_url(redis_server.url), Redis.from_url(redis_server.url)
    b_gate = CountingGate(RedisGate(b_client, key_prefix=prefix))
    b = DispatchQueue("m", b_gate, lambda: (None, 1), max_len=100, aging_s=5.0,
                      slot_ttl_s=30.0)
    gate_a = RedisGate(admin, key_prefix=prefix)
    assert await gate_a.acquire("m", "a1", 1, None, 1, 30)  # A holds the one slot
    yield Replicas(prefix, admin, gate_a, b_client, b_gate, b)
    await b.aclose()
    await admin.aclose()
    await b_client.aclose()


async def test_a_release_on_a_wakes_the_waiter_on_b_by_the_event(
        replicas: Replicas, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(queue_mod, "FALLBACK_POLL_S", 60.0)  # only the event is in time
    r = replicas
    async with listening(r):
        waiter = r.waiter()
        await r.queued()
        before = dict(r.b.wakeups)
        assert await r.a.release("m", "a1")
        await asyncio.wait_for(waiter, DEADLINE_S)
        assert r.b.wakeups["event"] > before["event"]
        assert r.b.wakeups["poll"] == before["poll"] == 0
        assert r.b.snapshot().hears_releases
    assert not r.b.hears_releases()


async def test_a_lost_event_is_made_up_for_by_the_fallback_poll(replicas: Replicas) -> None:
    r = replicas
    async with listening(r):
        waiter = r.waiter()
        await r.queued()
        before = dict(r.b.wakeups)
        # the slot goes without a message (as if the message were lost on the way)
        await r.admin.delete(f"{r.prefix}:{{up:m}}:slots", f"{r.prefix}:{{up:m}}:tokens")
        await asyncio.wait_for(waiter, DEADLINE_S)
        assert r.b.wakeups["poll"] > before["poll"]
        assert r.b.wakeups["event"] == before["event"]
        assert r.b.hears_releases()  # subscribed all along: it was the fallback poll


async def test_a_killed_subscriber_falls_back_to_polling_and_reconnects(
        replicas: Replicas) -> None:
    r = replicas
    # reconnects exactly 2 s after the kill: the poll (POLL_S) grants the waiter long before
    async with listening(r, backoff_s=(2.0, 2.0), rng=lambda: 1.0) as events:
        waiter = r.waiter()
        await r.queued()
        kill = ("CLIENT", "KILL", "TYPE", "pubsub")
        assert await r.admin.execute_command(*kill) >= 1  # type: ignore[no-untyped-call]
        await eventually(lambda: not r.b.hears_releases(), "B noticed the kill")
        before = dict(r.b.wakeups)
        assert await r.a.release("m", "a1")  # told, but nobody hears it
        await asyncio.wait_for(waiter, DEADLINE_S)
        assert r.b.wakeups["poll"] > before["poll"]
        assert r.b.wakeups["event"] == before["event"]
        await eventually(r.b.hears_releases, "B subscribed again")
        assert events.reconnects >= 1


async def test_the_gateway_starts_and_stops_its_subscriber(
        redis_server: RedisServer, tmp_path: Path) -> None:
    from gateway.service import build_gateway

    path = tmp_path / "g.yaml"
    path.write_text("models: [{name: a, upstreams: ['http://127.0.0.1:1', "
                    "'http://127.0.0.1:2']}]\n"
                    f"store: {{url: '{redis_server.url}'}}\n")
    gw = build_gateway(load_gateway_config(path, env={}), demo_tenants())
    assert gw.release_events is not None
    gw.release_events.start()
    queues = list(gw.queues.values())
    await eventually(lambda: all(q.hears_releases() for q in queues), "every queue hears")
    gauge = [line for line in gw.metrics.render().splitlines()
             if line.startswith("sluice_gateway_release_events_subscribed{")]
    assert len(gauge) == len(queues) and all(line.endswith(" 1.0") for line in gauge)
    await gw.aclose()
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("release-events")]
    assert not any(q.hears_releases() for q in queues)
