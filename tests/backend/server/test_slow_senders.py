"""Slow senders are cut off and open connections capped, on a real `sluice backend`.

The server runs with small limits from its flags (--request-read-timeout, --min-body-rate,
--max-connections); raw sockets; outcomes polled with generous deadlines, never timed. Its
open file descriptors are read from /proc/PID/fd.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.protocol.slow_client import (
    closed_by_server,
    connect,
    cuts,
    open_fds,
    post_head,
    request,
    trickle,
    wait_until,
)

from .conftest import Backend, start_backend

CHAT = json.dumps({"model": "sluice-tiny", "max_tokens": 2,
                   "messages": [{"role": "user", "content": "hi"}]}).encode()
CAP = 4


@pytest.fixture(scope="module")
def slow_limits(tiny_model_dir: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    b = start_backend(tmp_path_factory.mktemp("slow"), "--request-read-timeout", "2",
                      "--min-body-rate", "1000", "--max-connections", str(CAP))
    yield b
    b.stop()


def cut(b: Backend) -> dict[str, float]:
    return cuts(httpx.get(b.url + "/metrics", timeout=5).text, "sluice_backend_")


def chat_ok(b: Backend) -> bool:
    answer = request(b.port, post_head("/v1/chat/completions", len(CHAT)), CHAT)
    return answer.status == 200 and answer.json()["usage"]["completion_tokens"] >= 1


def settled(b: Backend, fds: int) -> None:
    wait_until(lambda: open_fds(b.pid) <= fds, f"the server's descriptors back to {fds}")
    wait_until(lambda: httpx.get(b.url + "/v1/state", timeout=5).json()["running"] == 0,
               "no request running in the engine")


def test_a_trickled_head_gets_408(slow_limits: Backend) -> None:
    b = slow_limits
    assert chat_ok(b)
    fds = open_fds(b.pid)
    before = cut(b)
    with connect(b.port) as sock:
        answer = trickle(sock, post_head("/v1/chat/completions", len(CHAT)))
    assert answer.status == 408
    err = answer.json()["error"]
    assert err["code"] == "request_timeout" and err["type"] == "invalid_request_error"
    assert chat_ok(b)
    settled(b, fds)
    assert cut(b)["head_timeout"] == before["head_timeout"] + 1


def test_a_trickled_body_gets_408(slow_limits: Backend) -> None:
    b = slow_limits
    assert chat_ok(b)
    fds = open_fds(b.pid)
    before = cut(b)
    with connect(b.port) as sock:
        sock.sendall(post_head("/v1/chat/completions", len(CHAT)))
        answer = trickle(sock, CHAT)
    assert answer.status == 408
    assert answer.json()["error"]["code"] == "request_timeout"
    assert chat_ok(b)
    settled(b, fds)
    assert cut(b)["body_timeout"] == before["body_timeout"] + 1


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/tokenize"])
def test_a_cut_body_ends_quietly(slow_limits: Backend, path: str) -> None:
    """Starlette raises ClientDisconnect in the handler once the protocol has cut the body:
    the client has its 408, and the server logs no traceback and counts no 500."""
    b = slow_limits
    assert chat_ok(b)
    fds, logged = open_fds(b.pid), len(b.log())
    with connect(b.port) as sock:
        sock.sendall(post_head(path, len(CHAT)))
        assert trickle(sock, CHAT).status == 408
    assert chat_ok(b)  # the cut request's handler ended long before this one
    settled(b, fds)
    new = b.log()[logged:]
    assert "Traceback" not in new and "ERROR" not in new, new
    assert 'status="500"' not in httpx.get(b.url + "/metrics", timeout=5).text


def test_the_default_cap_holds_the_gateways_pools_with_room_to_spare() -> None:
    """Each gateway replica may pool models[].max_connections connections to a backend: at
    the old default (4096), the deploy docs' 4 replicas × 1024 filled the cap, and the
    backend would have refused its own gateways (and every health check) with 503."""
    from backend.server.app import ServerSettings
    from gateway.config import ModelEntry
    from sluice.cli import build_parser

    pool = ModelEntry(name="m", upstream="http://127.0.0.1:1").max_connections
    args = build_parser().parse_args(["backend", "--model", "tiny", "--no-api-key"])
    for cap in (args.max_connections, ServerSettings().limits.max_connections):
        assert cap >= 4 * pool + 1024, cap


def test_connections_past_the_cap_get_503_until_the_slow_ones_are_cut(
        slow_limits: Backend) -> None:
    b = slow_limits
    assert chat_ok(b)
    fds = open_fds(b.pid)
    before = cut(b)
    slow = [connect(b.port) for _ in range(CAP)]
    for sock in slow:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
    refused = request(b.port, post_head("/v1/chat/completions", len(CHAT)), CHAT)
    assert not any(closed_by_server(sock) for sock in slow), "cut before the check"
    assert refused.status == 503
    assert refused.headers["retry-after"] == "1"
    err = refused.json()["error"]
    assert err["code"] == "too_many_connections" and err["type"] == "server_error"
    wait_until(lambda: all(closed_by_server(sock) for sock in slow), "the slow ones cut")
    for sock in slow:
        sock.close()
    assert chat_ok(b)
    settled(b, fds)
    assert cut(b)["too_many_connections"] == before["too_many_connections"] + 1
