"""Hostile input against the whole stack: the gateway (generation routes and the admin API)
in front of a real bundled backend (tiny model, keyed), through raw sockets so that every
byte of the body and the headers is the fuzzer's. Whatever is sent: never a 5xx, never a
hang. After each run nothing is left: no lease, no reservation, no capacity slot, no
request waiting, no upstream connection lent out; on the backend no running or waiting
sequence and every KV block free."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.config import Caps, QuotasConfig, TenantEntry, TenantsFile
from gateway.tenants import hash_key
from tests.backend.server.conftest import BACKEND_KEY, GATEWAY_KEY_ENV, Backend, start_backend
from tests.hostile import bodies, headers, json_trees, raw_request, texts

from .conftest import OTHER_KEY, TEST_KEY, ThreadedGateway, config_for

OPERATOR = "sk-fuzz-operator"
FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    from modelfiles.tiny_model import ensure_tiny_model

    ensure_tiny_model()
    b = start_backend(tmp_path_factory.mktemp("fuzz-backend"), api_key=BACKEND_KEY)
    yield b
    b.stop()


@pytest.fixture(scope="module")
def gw(backend: Backend) -> Iterator[ThreadedGateway]:
    mp = pytest.MonkeyPatch()
    mp.setenv(GATEWAY_KEY_ENV, BACKEND_KEY)
    mp.setenv("SLUICE_ADMIN_KEY", OPERATOR)
    caps = Caps(max_prompt_tokens=2048, max_tokens=8, on_exceed="clamp")
    quotas = QuotasConfig(tokens_per_minute=10**9, max_concurrency=64)
    tenants = TenantsFile(tenants=[  # the admin fuzzing may change "one", never "two"
        TenantEntry(id="one", keys=[hash_key(TEST_KEY)], quotas=quotas, caps=caps),
        TenantEntry(id="two", keys=[hash_key(OTHER_KEY)], quotas=quotas, caps=caps)])
    cfg = config_for(backend.url, upstream_model="sluice-tiny", api_key_env=GATEWAY_KEY_ENV)
    with ThreadedGateway(cfg, tenants) as g:
        yield g
    mp.undo()


def no_5xx(status: int, response: bytes) -> None:
    assert 0 < status < 500, response[:600]


async def nothing_left(gw: ThreadedGateway, backend: Backend) -> None:
    """Leases, reservations, slots, queues, connections, pool jobs; the backend's sequences
    and KV."""
    deadline = time.monotonic() + 30
    while True:
        state = await asyncio.to_thread(backend.state)
        g = gw.gateway
        usage = [gw.call(g.admission.store.usage(t)) for t in ("one", "two")]
        held = {"leases": len(g.admission.live),
                "reserved": sum(u["reserved"]["day"] for u in usage),
                "concurrency": sum(u["concurrency"] for u in usage),
                "inflight": g.metrics.inflight,
                "slots": sum(q.snapshot().slots_held for q in g.queues.values()),
                "queued": sum(q.snapshot().size for q in g.queues.values()),
                "lent": sum(m.pool.active for up in g.upstreams.values() for m in up.members),
                "pool jobs": sum(p.running + p.waiting + p.tenants for p in
                                 (g.tokenize_pool.snapshot(), g.parse_pool.snapshot())),
                "running": state["running"], "waiting": state["waiting"],
                "kv_used": state["kv_blocks_total"] - state["kv_blocks_free"]}
        if not any(held.values()):
            return
        assert time.monotonic() < deadline, f"left behind: {held}"
        await asyncio.sleep(0.05)


GENERATION = ["/v1/chat/completions", "/v1/completions"]
NUMERIC = ("x-sluice-deadline-ms", "content-length", "x-request-id", "content-type")


async def test_the_generation_routes_take_anything(gw: ThreadedGateway,
                                                   backend: Backend) -> None:
    port = gw.port
    seen: set[int] = set()

    @FUZZ
    @given(body=bodies("m"), hdrs=headers(*NUMERIC), path=st.sampled_from(GENERATION),
           authorized=st.booleans())
    def one(body: bytes, hdrs: list[tuple[bytes, bytes]], path: str,
            authorized: bool) -> None:
        auth = [(b"authorization", f"Bearer {TEST_KEY}".encode())] if authorized else []
        status, response = asyncio.run(raw_request(port, "POST", path, auth + hdrs, body))
        seen.add(status)
        no_5xx(status, response)

    await asyncio.to_thread(one)
    assert 200 in seen and 400 in seen  # the fuzzer reached the model and the refusals
    await nothing_left(gw, backend)


async def test_clients_that_leave_mid_answer_leave_nothing(gw: ThreadedGateway,
                                                           backend: Backend) -> None:
    """Streams cut after a random number of bytes, among hostile requests."""
    async def cut_after(n: int) -> None:
        body = (b'{"model":"m","stream":true,"max_tokens":8,'
                b'"messages":[{"role":"user","content":"tell me a story"}]}')
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                     b"authorization: Bearer " + TEST_KEY.encode() + b"\r\n"
                     b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        await reader.read(n)
        writer.close()

    await asyncio.gather(*(cut_after(n) for n in range(1, 400, 13)))
    await nothing_left(gw, backend)


ADMIN_PATHS = st.sampled_from(["", "/one", "/fuzz-tenant", "/one/keys", "/one/usage",
                               "/one/keys/key_0123456789abcdef", "/%ED%A0%80", "/a%00b"])
admin_bodies = st.one_of(
    st.fixed_dictionaries({"id": st.just("fuzz-tenant") | texts}, optional={
        "name": texts, "models": st.lists(texts, max_size=3), "weight": json_trees,
        "quotas": st.dictionaries(st.sampled_from(["tokens_per_minute", "max_concurrency",
                                                   "requests_per_minute", "max_queued"]),
                                  json_trees, max_size=3),
        "priority": json_trees, "caps": json_trees, "fail_mode": texts}),
    json_trees).map(lambda v: json.dumps(v, ensure_ascii=True).encode())


async def test_the_admin_api_takes_anything_and_stores_only_what_it_accepts(
        gw: ThreadedGateway, backend: Backend) -> None:
    port = gw.port
    auth = [(b"authorization", f"Bearer {OPERATOR}".encode()),
            (b"content-type", b"application/json")]

    @FUZZ
    @given(method=st.sampled_from(["GET", "POST", "PATCH", "DELETE", "PUT"]),
           path=ADMIN_PATHS, body=admin_bodies | bodies("m"), hdrs=headers(*NUMERIC))
    def one(method: str, path: str, body: bytes, hdrs: list[tuple[bytes, bytes]]) -> None:
        status, response = asyncio.run(raw_request(
            port, method, "/admin/v1/tenants" + path, auth + hdrs, body))
        no_5xx(status, response)

    await asyncio.to_thread(one)
    # whatever was stored reads back: the list is never a 500, and the tenant the fuzzing
    # could not touch is served as before
    async with httpx.AsyncClient(timeout=60) as client:
        listing = await client.get(gw.url + "/admin/v1/tenants",
                                   headers={"authorization": f"Bearer {OPERATOR}"})
        assert listing.status_code == 200, listing.text
        ok = await client.post(gw.url + "/v1/chat/completions",
                               headers={"authorization": f"Bearer {OTHER_KEY}"},
                               json={"model": "m", "max_tokens": 2,
                                     "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200, ok.text
    await nothing_left(gw, backend)


def test_the_strategies_reach_the_hard_cases() -> None:
    """The fuzzer's vocabulary holds what broke the servers before (issue #20)."""
    found: dict[str, Any] = {}

    @settings(max_examples=400, derandomize=True, deadline=None)
    @given(bodies("m"))
    def collect(body: bytes) -> None:
        if b"\\ud8" in body or b"\\udc" in body or b"\xed\xa0" in body:
            found["surrogate"] = True
        if body.count(b"[") > 64:
            found["deep"] = True
        if b"\xff" in body:
            found["bad utf-8"] = True

    collect()
    assert set(found) == {"surrogate", "deep", "bad utf-8"}
