"""Hostile input against the bundled model server alone (a real `sluice backend`, tiny
model), through raw sockets: every generation route and /v1/tokenize take any body and any
header bytes without a 5xx or a hang, and afterwards no sequence runs or waits and every KV
block is free. Whether its key guards it is test_auth.py's; this one serves without."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.hostile import bodies, headers, raw_request

from .conftest import Backend, start_backend

FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/tokenize"]


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    b = start_backend(tmp_path_factory.mktemp("fuzz"))
    yield b
    b.stop()


async def test_the_backend_takes_anything(backend: Backend) -> None:
    seen: set[int] = set()

    @FUZZ
    @given(body=bodies("sluice-tiny"), path=st.sampled_from(ROUTES),
           hdrs=headers("content-length", "x-request-id", "x-sluice-tenant", "content-type",
                        "traceparent"))
    def one(body: bytes, path: str, hdrs: list[tuple[bytes, bytes]]) -> None:
        status, response = asyncio.run(raw_request(backend.port, "POST", path, hdrs, body))
        seen.add(status)
        assert 0 < status < 500, response[:600]

    await asyncio.to_thread(one)
    assert 200 in seen and 400 in seen
    assert backend.proc.poll() is None  # and the engine lives: it still serves
    deadline = time.monotonic() + 30
    while True:
        s = await asyncio.to_thread(backend.state)
        if s["running"] == s["waiting"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]:
            break
        assert time.monotonic() < deadline, f"left behind: {s}"
        await asyncio.sleep(0.05)
