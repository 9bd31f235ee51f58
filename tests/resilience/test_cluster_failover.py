"""A Redis Cluster master dies under load (SIGKILL) and its replica takes over.

Two gateways (``store.replicas: 2``) share a private 3+3 cluster (tests/cluster.py) in front
of ``sluice fake-upstream``. Tenant ids are chosen by their hash slot: ``closed`` (fail_mode
closed) and ``open`` (fail_mode open, 20 requests per minute) live on the master the test
kills; ``steady`` lives on another one, and so does the tenant registry. While the replica
is being promoted:

- ``closed`` gets 503 store_unavailable with Retry-After, and 200 again once the cluster has
  a master for its slot, without any help;
- ``open`` is admitted by each gateway's local share, never more than 20 / 2 (plus what that
  share refills meanwhile); past it, 429;
- ``steady`` sees nothing: every one of its requests is a 200.

Afterwards no lease outlives its TTL (the leases ZSETs empty by themselves), and the killed
node, restarted, rejoins as a replica. Every wait polls with a deadline.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import cast

import httpx
import pytest
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from gateway.config import (
    AdmissionConfig,
    GatewayConfig,
    Listen,
    ModelEntry,
    QuotasConfig,
    StoreConfig,
    TenantEntry,
    TenantsFile,
)
from gateway.tenants import hash_key
from policies.quotas import Quotas
from policies.redis_store import RedisStore, lua_source
from policies.store import StoreUnavailable
from tests.backend.server.conftest import REPO_ROOT, free_port
from tests.cluster import LocalCluster, Node
from tests.gateway.test_replicas import wait_http

from .conftest import ThreadedGateway

REPLICAS = 2
OPEN_RPM = 20
SHARE = OPEN_RPM // REPLICAS  # what each gateway admits of `open` while its slot is down
LEASE_TTL_S = 2.0
KEYS = {"closed": "sk-closed", "open": "sk-open", "steady": "sk-steady"}


def tenant_on(cluster: LocalCluster, role: str, master: Node, avoid: bool = False) -> str:
    """A tenant id `role<n>` whose keys' slot is served by `master` (or not, with avoid)."""
    info = next(i for i in cluster.topology() if i.port == master.port)
    for n in range(10_000):
        tid = f"{role}{n}"
        if info.serves(key_slot(f"sluice:{{{tid}}}:bucket".encode())) != avoid:
            return tid
    raise AssertionError(f"no tenant id for {role} on {info}")


@dataclass
class Record:
    role: str
    status: int
    retry_after: str | None
    code: str | None
    at: float


@dataclass
class Rig:
    cluster: LocalCluster
    victim: Node
    tenants: dict[str, str]  # role -> tenant id
    gateways: list[ThreadedGateway]
    records: list[Record] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def post(self, client: httpx.Client, role: str, gw: int) -> Record:
        resp = client.post(self.gateways[gw].url + "/v1/chat/completions",
                           headers={"authorization": f"Bearer {KEYS[role]}"},
                           json={"model": "fake", "max_tokens": 4,
                                 "messages": [{"role": "user", "content": "hi"}]})
        code = None if resp.status_code == 200 else resp.json()["error"].get("code")
        rec = Record(role, resp.status_code, resp.headers.get("retry-after"), code,
                     time.monotonic())
        with self.lock:
            self.records.append(rec)
        return rec

    def of(self, role: str, since: float = 0.0) -> list[Record]:
        with self.lock:
            return [r for r in self.records if r.role == role and r.at >= since]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("cluster-failover")
    cluster = LocalCluster(tmp).start()
    procs: list[subprocess.Popen[bytes]] = []
    gateways: list[ThreadedGateway] = []
    try:
        registry = cluster.master_for("sluice:{registry:tenants}:version")
        victim = next(cluster.node(i.port) for i in cluster.topology()
                      if i.role == "master" and i.slots and i.port != registry.port)
        tenants = {"closed": tenant_on(cluster, "closed", victim),
                   "open": tenant_on(cluster, "open", victim),
                   "steady": tenant_on(cluster, "steady", victim, avoid=True)}
        up_port = free_port()
        log = tmp / "fake.log"
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "sluice.cli", "fake-upstream", "--port", str(up_port)],
            cwd=REPO_ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT))
        wait_http(f"http://127.0.0.1:{up_port}/health", procs[0], log)
        file = TenantsFile(tenants=[
            TenantEntry(id=tenants["closed"], keys=[hash_key(KEYS["closed"])]),
            TenantEntry(id=tenants["open"], keys=[hash_key(KEYS["open"])], fail_mode="open",
                        quotas=QuotasConfig(requests_per_minute=OPEN_RPM)),
            TenantEntry(id=tenants["steady"], keys=[hash_key(KEYS["steady"])])])
        for _ in range(REPLICAS):
            cfg = GatewayConfig(
                listen=Listen(port=free_port()), refresh_interval_s=3600,
                models=[ModelEntry(name="fake", upstream=f"http://127.0.0.1:{up_port}",
                                   kind="openai", tokenizer="bytes")],
                # a roomy timeout: a loaded 2-core host must not turn slowness into 503s
                # (a dead master refuses connections at once: it needs no timeout)
                store=StoreConfig(url=cluster.url, cluster=True, replicas=REPLICAS,
                                  timeout_s=1.0),
                admission=AdmissionConfig(lease_ttl_s=LEASE_TTL_S))
            gw = ThreadedGateway(cfg, file)
            gw.__enter__()
            gateways.append(gw)
        yield Rig(cluster, victim, tenants, gateways)
    finally:
        for gw in gateways:
            gw.__exit__(None, None, None)
        for p in procs:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        cluster.stop()


def wait_for(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.02)


def test_a_master_failover_under_load(rig: Rig) -> None:
    stop = threading.Event()

    def load(role: str) -> None:  # one request at a time, alternating gateways
        with httpx.Client(timeout=30) as client:
            i = 0
            while not stop.is_set():
                rig.post(client, role, i % REPLICAS)
                i += 1

    with httpx.Client(timeout=30) as client:
        for role in KEYS:  # each tenant is served through both gateways before the kill
            for gw in range(REPLICAS):
                assert rig.post(client, role, gw).status == 200, role
    # Redis does not replicate its script cache: the replica that takes over has no script
    # until the first NOSCRIPT makes the client load it there
    successor = rig.cluster.replica_of(rig.victim)
    sha = hashlib.sha1((lua_source("lib") + "\n" + lua_source("reserve")).encode()).hexdigest()
    with successor.client() as c:
        assert c.script_exists(sha) == [False]
    threads = [threading.Thread(target=load, args=(role,)) for role in ("closed", "steady")]
    for t in threads:
        t.start()
    try:
        wait_for("load before the kill", lambda: len(rig.of("steady")) >= 10, 20)
        killed_at = time.monotonic()
        rig.cluster.kill(rig.victim)

        # the closed tenant is refused, with an honest Retry-After
        wait_for("a 503 for the closed tenant",
                 lambda: any(r.status == 503 for r in rig.of("closed", killed_at)), 15)
        # the open tenant, meanwhile: each gateway admits its local share, then 429s
        with httpx.Client(timeout=30) as client:
            burst = [rig.post(client, "open", gw)
                     for gw in range(REPLICAS) for _ in range(SHARE + 5)]
        # and service comes back by itself once the replica is promoted
        refused_at = min(r.at for r in rig.of("closed", killed_at) if r.status == 503)
        wait_for("the closed tenant served again",
                 lambda: any(r.status == 200 for r in rig.of("closed", refused_at)), 30)
        recovered_at = time.monotonic()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)

    assert rig.cluster.master_for(f"sluice:{{{rig.tenants['closed']}}}:bucket") == successor
    with successor.client() as c:
        assert c.script_exists(sha) == [True]  # reloaded on NOSCRIPT, then run
    steady = rig.of("steady")
    assert [r for r in steady if r.status != 200] == []
    assert len(rig.of("steady", killed_at)) > 0
    closed = rig.of("closed", killed_at)
    refused = [r for r in closed if r.status != 200]
    assert refused and all(r.status == 503 and r.code == "store_unavailable"
                           and r.retry_after == "1" for r in refused), refused
    assert closed[-1].status == 200
    # the open tenant is never refused for the store; past its share, it is rate limited
    assert all(r.status in (200, 429) for r in burst), [r.status for r in burst]
    fail_open = [gw.gateway.admission.fail_open.get(rig.tenants["open"], 0)
                 for gw in rig.gateways]
    outage_s = recovered_at - killed_at
    refill = math.ceil(SHARE / 60 * outage_s)  # the local bucket refills at its own rate
    assert sum(fail_open) >= 1, "the open tenant was never admitted by its local share"
    assert all(n <= SHARE + refill for n in fail_open), (fail_open, SHARE, refill)
    # nothing beyond the limit plus each gateway's share was admitted, store and local
    elapsed_min = (time.monotonic() - rig.records[0].at) / 60
    admitted = sum(1 for r in rig.of("open") if r.status == 200)
    assert admitted <= OPEN_RPM * (1 + elapsed_min) + REPLICAS * (SHARE + refill)

    asyncio.run(leases_expire(rig))

    # the killed node, restarted, rejoins as a replica of the node that took its slots
    rig.cluster.restart(rig.victim)
    rig.cluster.wait_ok(masters=3)
    wait_for("the restarted node seen as a replica by every node",
             lambda: rig.cluster.roles(rig.victim) == {"replica"}, 15)


async def leases_expire(rig: Rig) -> None:
    """Every lease left in the leases ZSETs expires within its TTL, and is released."""
    store = RedisStore(rig.cluster.url, cluster=True, timeout_s=1.0)
    raw = RedisCluster.from_url(rig.cluster.url)
    try:
        with next(n for n in rig.cluster.nodes if n.alive).client() as node:
            now_s, now_us = cast(tuple[int, int], node.time())  # Redis TIME, as the leases
        now = now_s * 1_000_000 + now_us
        for tid in rig.tenants.values():
            leases = store.keys(tid)[2]
            assert key_slot(leases.encode()) == key_slot(store.keys(tid)[0].encode())
            live = cast(list[tuple[bytes, float]],
                        await raw.zrange(leases, 0, -1, withscores=True))
            for _, expiry in live:
                assert expiry <= now + LEASE_TTL_S * 1_000_000  # none renewed past its TTL
        deadline = time.monotonic() + LEASE_TTL_S + 5
        for tid in rig.tenants.values():
            while await store.concurrency(tid) > 0:  # (it releases what has expired)
                assert time.monotonic() < deadline, f"a lease of {tid} outlived its TTL"
                await asyncio.sleep(0.05)
            assert await raw.zcard(store.keys(tid)[2]) == 0  # released, not only expired
    finally:
        await store.close()
        await raw.aclose()


async def test_a_burst_stays_within_the_connections_per_node(rig: Rig) -> None:
    """A cluster node raises instead of queueing when its connections are all busy: the
    store queues calls on its permits instead, so a burst is served, never refused, and no
    node gets more than max_connections of this client's connections."""
    rig.cluster.wait_ok()
    store = RedisStore(rig.cluster.url, cluster=True, timeout_s=2.0, max_connections=2,
                       key_prefix=f"burst{time.monotonic_ns()}")
    try:
        decisions = await asyncio.gather(*(
            store.reserve(f"t{i % 30}", f"r{i}", 1, Quotas(), 30) for i in range(300)))
        assert all(d.granted for d in decisions)
        client = store.client
        assert isinstance(client, RedisCluster)
        assert {len(n._connections) <= 2 for n in client.get_nodes()} == {True}
    finally:
        await store.close()


async def test_an_unreachable_cluster_is_store_unavailable_within_the_deadline() -> None:
    store = RedisStore(f"redis://127.0.0.1:{free_port()}", cluster=True, timeout_s=0.2)
    try:
        for call in (store.reserve("a", "r", 1, Quotas(), 5), store.usage("a"), store.ping()):
            began = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await call
            assert time.monotonic() - began < store.deadline_s + 1.0  # (slack: a busy host)
    finally:
        await store.close()
