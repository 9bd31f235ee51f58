"""Slow clients (a slowloris that never reads) and a slow Redis behind a delaying proxy."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.config import Caps, PriorityRange, TenantEntry, TenantsFile
from gateway.tenants import hash_key
from tests.gateway.conftest import OTHER_KEY, TEST_KEY, tenants_for_tests
from tests.policies.conftest import RedisServer

from .conftest import (
    DelayProxy,
    Replica,
    ThreadedGateway,
    assert_no_leaks,
    auth,
    chat,
    pool_config,
    raw_stream_socket,
    tasks,
)


def test_a_client_that_never_reads_is_cancelled(replicas: list[Replica]) -> None:
    a, b = replicas
    cfg = pool_config([a.url, b.url], client_stall_s=1.0, send_buffer_bytes=16384)
    with ThreadedGateway(cfg, tenants_for_tests()) as gw:
        assert httpx.post(gw.url + "/v1/chat/completions", headers=auth(), timeout=30,
                          json={**chat(4), "stream": False}).status_code == 200
        idle = tasks(gw)
        aborted = a.state()["aborted"] + b.state()["aborted"]
        socks = [raw_stream_socket(gw.port, chat(1900)) for _ in range(2)]
        try:
            deadline = time.monotonic() + 60
            while gw.gateway.metrics.client_stalls < 2:
                assert time.monotonic() < deadline, "the stalled clients were never cancelled"
                time.sleep(0.05)
            # their requests were aborted in the engines before generating everything
            assert a.state()["aborted"] + b.state()["aborted"] == aborted + 2
            assert gw.gateway.ledger.by_key[("one", "m", "cancelled")] == 2
            assert gw.gateway.ledger.by_tenant["one"].completion_tokens < 4 + 2 * 1900
            assert_no_leaks(gw, replicas, idle)
        finally:
            for s in socks:
                s.close()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis-resilience"))
    server.start()
    yield server
    server.stop()


def two_modes() -> TenantsFile:
    return TenantsFile(tenants=[
        TenantEntry(id="one", keys=[hash_key(TEST_KEY)], fail_mode="closed",
                    priority=PriorityRange(default=4), caps=Caps()),
        TenantEntry(id="open", keys=[hash_key(OTHER_KEY)], fail_mode="open"),
    ])


def test_a_slow_redis_meets_tight_timeouts_and_fail_modes(replicas: list[Replica],
                                                          redis_server: RedisServer) -> None:
    a, b = replicas
    with DelayProxy(redis_server.port) as proxy:
        cfg = pool_config([a.url, b.url], store_url=f"redis://127.0.0.1:{proxy.port}/0")
        with ThreadedGateway(cfg, two_modes()) as gw:
            def post(key: str) -> httpx.Response:
                return httpx.post(gw.url + "/v1/chat/completions", headers=auth(key),
                                  json={**chat(4), "stream": False}, timeout=30)

            assert post(TEST_KEY).status_code == 200
            assert post(OTHER_KEY).status_code == 200
            idle = tasks(gw)
            proxy.delay = 0.5  # every Redis answer now comes 5x past store.timeout_s
            start = time.monotonic()
            closed = post(TEST_KEY)
            assert closed.status_code == 503
            assert closed.json()["error"]["code"] == "store_unavailable"
            assert closed.headers["retry-after"] == "1"
            assert time.monotonic() - start < 0.5  # the timeout, not Redis, decided
            opened = post(OTHER_KEY)
            assert opened.status_code == 200  # admitted by the local share, and counted
            assert gw.gateway.admission.fail_open == {"open": 1}
            proxy.delay = 0.0
            assert post(TEST_KEY).status_code == 200
            # the reservations and slots the slow calls left in Redis are undone
            assert_no_leaks(gw, replicas, idle, redis_url=redis_server.url)
