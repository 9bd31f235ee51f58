"""Release events on a real redis-server: the gate's scripts publish what they free on the
upstream's shard channel, and ``ReleaseEvents`` hears it, survives a killed connection, and
leaves no task or connection behind. Waits poll a condition under a deadline; nothing
asserts how long anything took."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster

from policies.capacity import RedisGate
from policies.release_events import ReleaseEvents
from policies.store import StoreUnavailable
from tests.cluster import LocalCluster, Node
from tests.policies.conftest import RedisServer, eventually

DEADLINE_S = 10.0


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[Redis]:
    r = Redis.from_url(redis_server.url)
    yield r
    await r.aclose()


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


@pytest.fixture
def gate(client: Redis, prefix: str) -> RedisGate:
    return RedisGate(client, key_prefix=prefix)


async def next_message(pubsub: PubSub, timeout: float = 0.3) -> Any:
    """The next smessage within ``timeout``, or None (silence is what some tests expect)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.05)
        if msg is not None:
            return msg
    return None


async def pubsub_clients(client: Redis) -> int:
    return len(await client.client_list(_type="pubsub"))


async def test_the_scripts_publish_the_capacity_they_free(gate: RedisGate,
                                                          client: Redis) -> None:
    pubsub = client.pubsub()
    await pubsub.ssubscribe(gate.channel("m"))
    assert (await pubsub.get_message(timeout=2))["type"] == "ssubscribe"
    try:
        assert await gate.acquire("m", "r1", 10, None, 2, 30)
        assert await gate.renew("m", "r1", 30)
        assert await gate.in_flight("m") == (1, 10)
        assert await next_message(pubsub) is None  # nothing freed: nothing told
        assert await gate.release("m", "r1")
        msg = await next_message(pubsub, timeout=DEADLINE_S)
        assert msg is not None and msg["data"] == b"1"
        assert msg["channel"].decode() == gate.channel("m")
        assert not await gate.release("m", "r1")  # twice: nothing freed the second time
        assert not await gate.renew("m", "r1", 30)  # gone: whoever removed it told
        assert await next_message(pubsub) is None
        # an expired slot swept by another replica's acquire frees capacity: told too
        assert await gate.acquire("m", "dead", 10, None, 2, 0.05)
        await asyncio.sleep(0.1)
        assert await gate.acquire("m", "r2", 10, None, 2, 30)
        msg = await next_message(pubsub, timeout=DEADLINE_S)
        assert msg is not None and msg["data"] == b"1"
        # another upstream's channel is another one: nothing here
        assert await gate.acquire("other", "r3", 10, None, 2, 30)
        assert await gate.release("other", "r3")
        assert await next_message(pubsub) is None
    finally:
        await pubsub.aclose()  # type: ignore[no-untyped-call]


async def test_a_release_on_one_client_wakes_the_listener_of_another(
        gate: RedisGate, redis_server: RedisServer, prefix: str) -> None:
    woken: list[str] = []
    b = Redis.from_url(redis_server.url)  # replica B's own client, as in its own process
    gate_b = RedisGate(b, key_prefix=prefix)
    events = ReleaseEvents(b, {"m": gate_b.channel("m"), "n": gate_b.channel("n")},
                           {"m": lambda: woken.append("m"), "n": lambda: woken.append("n")})
    try:
        assert not events.hears("m")
        events.start()
        await eventually(lambda: events.hears("m") and events.hears("n"), "subscribed")
        assert events.snapshot().subscribed == 2
        woken.clear()  # subscribing wakes once (for what it missed): not a release
        assert await gate.acquire("m", "r1", 1, None, 1, 30)
        assert await gate.release("m", "r1")  # on replica A's client
        await eventually(lambda: "m" in woken, "the release on A woke B's listener")
        assert "n" not in woken
        assert events.snapshot().messages >= 1
    finally:
        await events.aclose()
        await b.aclose()


async def test_a_killed_connection_is_reopened(gate: RedisGate, client: Redis,
                                               redis_server: RedisServer) -> None:
    woken: list[str] = []
    b = Redis.from_url(redis_server.url)
    events = ReleaseEvents(b, {"m": gate.channel("m")}, {"m": lambda: woken.append("m")},
                           backoff_s=(0.05, 0.05))
    try:
        events.start()
        await eventually(lambda: events.hears("m"), "subscribed")
        killed = await client.execute_command(  # type: ignore[no-untyped-call]
            "CLIENT", "KILL", "TYPE", "pubsub")
        assert killed >= 1
        await eventually(lambda: events.reconnects >= 1, "the link noticed and reopened")
        await eventually(lambda: events.hears("m"), "subscribed again")
        woken.clear()
        assert await gate.acquire("m", "r1", 1, None, 1, 30)
        assert await gate.release("m", "r1")
        await eventually(lambda: bool(woken), "a release heard on the new connection")
    finally:
        await events.aclose()
        await b.aclose()


async def test_a_bug_in_a_link_is_logged_and_the_link_reopened(
        gate: RedisGate, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    woken: list[str] = []
    b = Redis.from_url(redis_server.url)
    events = ReleaseEvents(b, {"m": gate.channel("m")}, {"m": lambda: woken.append("m")},
                           backoff_s=(0.05, 0.05))
    listen = ReleaseEvents._listen
    broken = [True]

    async def once_broken(self: ReleaseEvents, pubsub: PubSub, channels: list[str]) -> None:
        if broken.pop() if broken else False:
            raise KeyError("type")  # an answer nobody expected
        await listen(self, pubsub, channels)

    monkeypatch.setattr(ReleaseEvents, "_listen", once_broken)
    try:
        events.start()
        await eventually(lambda: events.hears("m") and events.reconnects == 1,
                         "reopened after the bug, and subscribed")
        woken.clear()
        assert await gate.acquire("m", "r1", 1, None, 1, 30)
        assert await gate.release("m", "r1")
        await eventually(lambda: bool(woken), "a release heard after the bug")
    finally:
        await events.aclose()
        await b.aclose()


async def test_aclose_leaves_no_task_and_no_connection(gate: RedisGate, client: Redis,
                                                       redis_server: RedisServer) -> None:
    before = await pubsub_clients(client)
    b = Redis.from_url(redis_server.url)
    events = ReleaseEvents(b, {up: gate.channel(up) for up in "abc"},
                           {up: lambda: None for up in "abc"})
    events.start()
    await eventually(lambda: all(events.hears(up) for up in "abc"), "subscribed")
    assert await pubsub_clients(client) == before + 1  # one connection for one Redis
    await events.aclose()
    await b.aclose()
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("release-events")]
    assert not any(events.hears(up) for up in "abc")
    deadline = asyncio.get_running_loop().time() + DEADLINE_S
    while await pubsub_clients(client) != before:
        assert asyncio.get_running_loop().time() < deadline, "the subscriber's connection"
        await asyncio.sleep(0.01)


# ---- on a Redis Cluster (tests/cluster.py: 3 masters + 3 replicas) ----------------------------
async def release_when_reachable(gate: RedisGate, upstream: str) -> None:
    """Take and give back a slot, trying again while the cluster client finds its way."""
    loop = asyncio.get_running_loop()
    end = loop.time() + DEADLINE_S
    while True:
        try:
            assert await gate.acquire(upstream, "r", 1, None, 10, 30)
            assert await gate.release(upstream, "r")
            return
        except StoreUnavailable:
            if loop.time() > end:
                raise
            await asyncio.sleep(0.1)


def synced(replica: Node) -> bool:
    with replica.client() as c:
        return str(c.info("replication").get("master_link_status")) == "up"


@pytest.fixture
async def cluster_client(redis_cluster: LocalCluster) -> AsyncIterator[RedisCluster]:
    c = RedisCluster.from_url(redis_cluster.url)
    await c.initialize()
    yield c
    await c.aclose()


async def test_on_a_cluster_each_channel_is_heard_from_the_master_of_its_slot(
        redis_cluster: LocalCluster, cluster_client: RedisCluster, prefix: str) -> None:
    gate = RedisGate(cluster_client, key_prefix=prefix, cluster=True)
    ups = [f"u{i}" for i in range(12)]
    masters = {redis_cluster.master_for(gate.channel(up)).port for up in ups}
    assert len(masters) >= 2  # the channels spread over the masters
    woken: list[str] = []
    events = ReleaseEvents(cluster_client, {up: gate.channel(up) for up in ups},
                           {up: lambda up=up: woken.append(up) for up in ups})  # type: ignore[misc]
    events.start()
    try:
        await eventually(lambda: all(events.hears(up) for up in ups), "all subscribed")
        woken.clear()
        for up in ups:
            await release_when_reachable(gate, up)
        await eventually(lambda: set(woken) == set(ups), "every release heard")
    finally:
        await events.aclose()


async def test_on_a_cluster_a_link_follows_its_slot_to_the_promoted_replica(
        redis_cluster: LocalCluster, cluster_client: RedisCluster, prefix: str) -> None:
    gate = RedisGate(cluster_client, key_prefix=prefix, cluster=True)
    woken: list[str] = []
    events = ReleaseEvents(cluster_client, {"m": gate.channel("m")},
                           {"m": lambda: woken.append("m")}, backoff_s=(0.1, 0.5))
    events.start()
    master = redis_cluster.master_for(gate.channel("m"))
    replica = redis_cluster.replica_of(master)
    try:
        await eventually(lambda: events.hears("m"), "subscribed")
        # a replica that never synced refuses to take over (its data is "too old")
        await eventually(lambda: synced(replica), "the replica synced with its master")
        redis_cluster.kill(master)
        await eventually(lambda: not events.hears("m"), "the link lost its node")
        await eventually(lambda: events.hears("m"), "subscribed again", timeout=30)
        woken.clear()
        await release_when_reachable(gate, "m")
        await eventually(lambda: "m" in woken, "a release heard from the new master")
        assert events.reconnects >= 1
    finally:
        await events.aclose()
        redis_cluster.restart(master)
        await asyncio.to_thread(redis_cluster.wait_ok)


async def test_one_call_renews_every_slot_of_a_beat(gate: RedisGate, client: Redis) -> None:
    from policies.capacity import MemoryGate

    for g in (gate, MemoryGate()):
        for rid in ("a", "b", "c"):
            assert await g.acquire("m", rid, 10, None, 8, 0.3)
        assert await g.release("m", "b")
        await client.config_resetstat()
        assert await g.renew_many("m", ["a", "b", "c", "zz"], 30) == [True, False, True, False]
        if g is gate:  # the Redis gate's beat: one round trip
            stats = await client.info("commandstats")
            assert stats["cmdstat_evalsha"]["calls"] == 1, stats
        assert await g.renew_many("m", [], 30) == []
        await asyncio.sleep(0.4)  # past the first TTL: the renewed slots live on
        assert await g.in_flight("m") == (2, 20)
        for rid in ("a", "c"):
            assert await g.release("m", rid)
