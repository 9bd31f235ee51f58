"""Under saturation, through the gateway: priority 0 waits less than priority 9 (which
still completes), and a flooding tenant does not starve another of the same priority."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.config import Capacity, PriorityRange, TenantEntry, TenantsFile
from gateway.tenants import hash_key

from .conftest import ThreadedGateway, config_for
from .fake_backend import FakeBackend


@pytest.fixture
def busy() -> Iterator[FakeBackend]:
    with FakeBackend(chunks=5) as f:
        f.mode = "slow"
        yield f


def saturated(fake: FakeBackend) -> ThreadedGateway:
    cfg = config_for(fake.url, kind="openai", tokenizer="bytes", capacity=Capacity(max_seqs=2),
                     supports=["stop", "seed", "user"])
    ts = TenantsFile(tenants=[
        TenantEntry(id=t, keys=[hash_key(f"sk-{t}")], priority=PriorityRange(min=0, max=9,
                                                                              default=5))
        for t in ("a", "b")])
    return ThreadedGateway(cfg, ts)


async def call(client: httpx.AsyncClient, gw: ThreadedGateway, tenant: str,
               priority: int) -> dict[str, Any]:
    resp = await client.post(gw.url + "/v1/chat/completions", headers={
        "authorization": f"Bearer sk-{tenant}"}, json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
        "priority": priority})
    return {"status": resp.status_code, "queue_ms": int(resp.headers["x-sluice-queue-ms"]),
            "tenant": tenant, "priority": priority}


async def test_priority_zero_waits_less_and_nine_still_completes(busy: FakeBackend) -> None:
    with saturated(busy) as gw:
        async with httpx.AsyncClient(timeout=120) as client:
            jobs = [call(client, gw, "a", 9 if i % 2 else 0) for i in range(40)]
            results = await asyncio.gather(*jobs)
    assert all(r["status"] == 200 for r in results)  # priority 9 completes too
    waits = {p: sorted(r["queue_ms"] for r in results if r["priority"] == p) for p in (0, 9)}
    p95 = {p: v[int(len(v) * 0.95) - 1] for p, v in waits.items()}
    assert p95[0] < p95[9], p95
    assert statistics.median(waits[0]) < statistics.median(waits[9])


async def test_a_flood_does_not_starve_a_tenant_of_the_same_priority(
        busy: FakeBackend) -> None:
    with saturated(busy) as gw:
        async with httpx.AsyncClient(timeout=120) as client:
            flood = [asyncio.ensure_future(call(client, gw, "a", 5)) for _ in range(40)]
            await asyncio.sleep(0.3)  # a's 40 are queued first
            b = [asyncio.ensure_future(call(client, gw, "b", 5)) for _ in range(10)]
            results = await asyncio.gather(*flood, *b)
        dispatched = dict(gw.gateway.queues["m"].snapshot().dispatched)
    assert all(r["status"] == 200 for r in results)
    b_wait = statistics.median(r["queue_ms"] for r in results if r["tenant"] == "b")
    a_wait = statistics.median(r["queue_ms"] for r in results if r["tenant"] == "a")
    assert b_wait < a_wait  # b, arriving after a's flood, did not wait behind all of it
    assert dispatched["b"] == 10
