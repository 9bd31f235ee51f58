"""Three `sluice gateway` processes sharing one Redis, or one Redis Cluster (3 masters + 3
replicas, tests/cluster.py): no overshoot, exact settlement, and a killed replica's leases
and reservations expire by themselves."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.tenants import hash_key
from gateway.tokens import ByteCounter
from policies.redis_store import RedisStore
from tests.backend.server.conftest import free_port
from tests.cluster import redis_cluster
from tests.policies.conftest import RedisServer

__all__ = ["redis_cluster"]  # the session's cluster, for the "cluster" stack

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-acme"
TPM = 10_000
LEASE_TTL_S = 2.0


@dataclass
class Stack:
    redis_url: str
    cluster: bool
    gateways: list[subprocess.Popen[bytes]]
    urls: list[str]
    tenant: str

    def store(self) -> RedisStore:
        """A store of the gateways' Redis (or cluster), to read what they left there."""
        return RedisStore(self.redis_url, timeout_s=1.0, cluster=self.cluster)


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited:\n{log.read_text()}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not start:\n{log.read_text()}")


@pytest.fixture(scope="module", params=["redis", "cluster"])
def stack(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("replicas")
    cluster = request.param == "cluster"
    redis: RedisServer | None = None
    if cluster:
        url = request.getfixturevalue("redis_cluster").url
    else:
        redis = RedisServer(tmp)
        redis.start()
        url = redis.url
    procs: list[subprocess.Popen[bytes]] = []
    try:
        up_port = free_port()
        log = tmp / "fake.log"
        # each answer streams 20 chunks over ~1 s: admitted requests stay in flight together
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "sluice.cli", "fake-upstream", "--port", str(up_port),
             "--chunks", "20", "--delay-ms", "50"], cwd=REPO, stdout=log.open("wb"),
            stderr=subprocess.STDOUT))
        wait_http(f"http://127.0.0.1:{up_port}/health", procs[0], log)
        tenant = f"acme{os.getpid()}{request.param}"  # the cluster is the session's
        (tmp / "tenants.yaml").write_text(json.dumps({"tenants": [{
            "id": tenant, "keys": [hash_key(KEY)], "quotas": {"tokens_per_minute": TPM}}]}))
        urls = []
        for i in range(3):
            port = free_port()
            cfg = tmp / f"gateway{i}.yaml"
            cfg.write_text(json.dumps({
                "listen": {"host": "127.0.0.1", "port": port},
                "tenants_file": "tenants.yaml",
                "store": {"url": url, "cluster": cluster, "replicas": 3, "timeout_s": 1.0},
                "admission": {"lease_ttl_s": LEASE_TTL_S},
                "models": [{"name": "fake", "upstream": f"http://127.0.0.1:{up_port}",
                            "kind": "openai", "tokenizer": "bytes"}]}))
            log = tmp / f"gateway{i}.log"
            proc = subprocess.Popen([sys.executable, "-m", "sluice.cli", "gateway", "--config",
                                     str(cfg), "--log-level", "warning"], cwd=REPO,
                                    stdout=log.open("wb"), stderr=subprocess.STDOUT)
            procs.append(proc)
            wait_http(f"http://127.0.0.1:{port}/healthz", proc, log)
            urls.append(f"http://127.0.0.1:{port}")
        yield Stack(url, cluster, procs[1:], urls, tenant)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
        if redis is not None:
            redis.stop()


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"request {i}: say something"}]


async def one(client: httpx.AsyncClient, url: str, i: int, max_tokens: int) -> dict[str, Any]:
    body = {"model": "fake", "messages": messages(i), "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + "/v1/chat/completions", json=body,
                             headers={"authorization": f"Bearer {KEY}"}) as resp:
        admitted_at = time.monotonic()
        usage = None
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
        return {"status": resp.status_code, "usage": usage, "at": admitted_at,
                "max_tokens": max_tokens, "i": i}


async def test_no_overshoot_across_three_replicas_and_exact_settlement(stack: Stack) -> None:
    rng = random.Random(7)
    plan = [(i, rng.randint(20, 400)) for i in range(300)]
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        start = time.monotonic()
        results = await asyncio.gather(*(one(client, stack.urls[i % 3], i, m)
                                         for i, m in plan))
    granted = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 429]
    assert len(granted) + len(refused) == 300, {r["status"] for r in results}
    assert refused, "the limit was never reached: the test proves nothing"
    counter = ByteCounter()
    worst = 0
    for r in granted:
        worst += await counter.count("chat", messages(r["i"])) + r["max_tokens"]
    last_admission = max(r["at"] for r in granted)
    refill = TPM / 60 * (last_admission - start)
    # Every admitted request is still streaming when the last one is admitted (each takes
    # ~1 s), so no refund happened yet: only the bucket and its refill were spent.
    assert worst <= TPM + refill, (worst, refill)
    assert worst > TPM * 0.9  # and it was really used up to the limit
    # settled = what the clients were told they used
    told = sum(r["usage"]["total_tokens"] for r in granted)
    store = stack.store()
    try:
        deadline = time.monotonic() + 5
        while True:
            usage = await store.usage(stack.tenant)
            if usage["reserved"]["day"] == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert usage["reserved"]["day"] == 0
        assert usage["settled"]["day"] == told
        assert usage["concurrency"] == 0
    finally:
        await store.close()


async def test_a_killed_replica_leases_expire(stack: Stack) -> None:
    victim, url = stack.gateways[2], stack.urls[2]
    store = stack.store()
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            streams = [asyncio.ensure_future(one(client, url, 1000 + i, 20)) for i in range(5)]
            deadline = time.monotonic() + 10
            while await store.concurrency(stack.tenant) < 5 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert await store.concurrency(stack.tenant) == 5
            victim.send_signal(signal.SIGKILL)  # no settlement, no release: only the TTL
            victim.wait()
            killed_at = time.monotonic()
            await asyncio.gather(*streams, return_exceptions=True)
        while await store.concurrency(stack.tenant) > 0:
            assert time.monotonic() - killed_at < LEASE_TTL_S + 1.0
            await asyncio.sleep(0.05)
        usage = await store.usage(stack.tenant)
        assert usage["reserved"]["day"] == 0  # released (charged at their worst case)
    finally:
        await store.close()
