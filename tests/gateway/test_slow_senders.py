"""Slow senders are cut off and open connections capped, on the gateway's own listener.

``ThreadedGateway`` serves with the same protocol as `sluice gateway` (protocol/server.py)
and the limits of its config; the last test runs `sluice gateway` itself from a YAML file.
Raw sockets; small limits; outcomes polled with generous deadlines, never timed.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml
from pydantic import ValidationError

from gateway.config import GatewayConfig, Listen, Timeouts, apply_env
from gateway.tenants import hash_key
from protocol.limits import ConnectionLimits
from tests.backend.server.conftest import REPO_ROOT, free_port
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

from .conftest import TEST_KEY, ThreadedGateway, auth, config_for, tenants_for_tests
from .fake_backend import FakeBackend

CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
KEY = f"authorization: Bearer {TEST_KEY}"
OPERATOR = "sk-operator-for-slow-sender-tests"


def limited(upstream: str, *, read_s: float = 0.3, rate: int = 1000,
            max_connections: int = 64) -> GatewayConfig:
    config = config_for(upstream)
    return config.model_copy(update={
        "timeouts": Timeouts(request_read_s=read_s, body_min_bytes_per_s=rate),
        "listen": Listen(port=config.listen.port, max_connections=max_connections)})


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeBackend]:
    with FakeBackend() as f:
        yield f


def tasks(gw: ThreadedGateway) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=5).text
    line = next(x for x in text.splitlines() if x.startswith("sluice_gateway_asyncio_tasks "))
    return float(line.rsplit(" ", 1)[1])


def cut(gw: ThreadedGateway) -> dict[str, float]:
    return cuts(httpx.get(gw.url + "/metrics", timeout=5).text, "sluice_gateway_")


@contextmanager
def errors_logged() -> Iterator[list[str]]:
    """What is logged at ERROR meanwhile, by Sluice (root) or by uvicorn (which does not
    propagate to the root)."""
    errors: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            errors.append(f"{record.name}: {record.getMessage()}")

    handler = Keep(logging.ERROR)
    loggers = [logging.getLogger(), logging.getLogger("uvicorn")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield errors
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def chat_ok(gw: ThreadedGateway) -> bool:
    answer = request(gw.port, post_head("/v1/chat/completions", len(CHAT), KEY), CHAT)
    return answer.status == 200 and answer.json()["choices"][0]["message"]["content"] != ""


def settled(gw: ThreadedGateway, fds: int, idle_tasks: float) -> None:
    """Nothing left behind: connections, file descriptors, event-loop tasks."""
    wait_until(lambda: not gw.server.server_state.connections, "no connection left open")
    wait_until(lambda: open_fds() <= fds, f"file descriptors back to {fds}")
    wait_until(lambda: tasks(gw) <= idle_tasks, f"asyncio tasks back to {idle_tasks}")


def test_a_trickled_head_gets_408_and_leaves_nothing_behind(fake: FakeBackend) -> None:
    with ThreadedGateway(limited(fake.url), tenants_for_tests()) as gw:
        assert chat_ok(gw)  # warm: pools and lazy imports before the baselines
        idle_tasks, fds = tasks(gw), open_fds()
        with connect(gw.port) as sock:
            answer = trickle(sock, post_head("/v1/chat/completions", len(CHAT), KEY))
        assert answer.status == 408
        err = answer.json()["error"]
        assert err["code"] == "request_timeout" and err["type"] == "invalid_request_error"
        assert chat_ok(gw)  # a normal request is served as before
        settled(gw, fds, idle_tasks)
        assert cut(gw) == {"head_timeout": 1, "body_timeout": 0, "head_too_large": 0,
                           "trailers_too_large": 0, "too_many_connections": 0,
                           "bad_request": 0, "idle": 0}


def test_a_trickled_body_gets_408_and_the_request_ends(fake: FakeBackend) -> None:
    with ThreadedGateway(limited(fake.url), tenants_for_tests()) as gw:
        assert chat_ok(gw)
        idle_tasks, fds = tasks(gw), open_fds()
        sent = len(fake.bodies)
        with connect(gw.port) as sock:
            sock.sendall(post_head("/v1/chat/completions", len(CHAT), KEY))
            answer = trickle(sock, CHAT)
        assert answer.status == 408
        assert answer.json()["error"]["code"] == "request_timeout"
        assert len(fake.bodies) == sent  # nothing went upstream
        assert chat_ok(gw)
        settled(gw, fds, idle_tasks)
        assert cut(gw)["body_timeout"] == 1


def test_a_cut_admin_body_ends_quietly(fake: FakeBackend,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The admin API reads its body through Starlette, which raises ClientDisconnect once
    the protocol has cut it: the client has its 408; no 500, no traceback is logged."""
    monkeypatch.setenv("SLUICE_ADMIN_KEY", OPERATOR)
    body = json.dumps({"id": "slow"}).encode()
    with ThreadedGateway(limited(fake.url), tenants_for_tests()) as gw, \
            errors_logged() as errors:
        with connect(gw.port) as sock:
            sock.sendall(post_head("/admin/v1/tenants", len(body),
                                   f"authorization: Bearer {OPERATOR}"))
            answer = trickle(sock, body)
        assert answer.status == 408
        assert chat_ok(gw)
        wait_until(lambda: not gw.server.server_state.tasks, "the cut request has ended")
        assert errors == []
        assert 'status="500"' not in httpx.get(gw.url + "/metrics", timeout=5).text


def test_a_body_trickled_after_a_401_is_cut_too(fake: FakeBackend) -> None:
    """The gateway answers a bad key before reading the body; the rest of that body must
    not hold the connection open."""
    with ThreadedGateway(limited(fake.url), tenants_for_tests()) as gw, \
            connect(gw.port) as sock:
        head = post_head("/v1/chat/completions", 100_000, "authorization: Bearer nope")
        sock.sendall(head.replace(b"connection: close\r\n", b""))
        answer = trickle(sock, b"x" * 2000, through_answer=True)
        assert answer.status == 401
        wait_until(lambda: not gw.server.server_state.connections, "the connection cut")


def test_connections_past_the_cap_get_503_until_the_slow_ones_are_cut(
        fake: FakeBackend) -> None:
    config = limited(fake.url, read_s=2.0, max_connections=4)
    with ThreadedGateway(config, tenants_for_tests()) as gw:
        assert chat_ok(gw)
        idle_tasks, fds = tasks(gw), open_fds()
        slow = [connect(gw.port) for _ in range(4)]
        for sock in slow:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        refused = request(gw.port, post_head("/v1/chat/completions", len(CHAT), KEY), CHAT)
        assert not any(closed_by_server(sock) for sock in slow), "cut before the check"
        assert refused.status == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["retry-after-ms"] == "1000"
        err = refused.json()["error"]
        assert err["code"] == "too_many_connections" and err["type"] == "server_error"
        wait_until(lambda: all(closed_by_server(sock) for sock in slow), "the slow ones cut")
        for sock in slow:
            sock.close()
        assert chat_ok(gw)
        settled(gw, fds, idle_tasks)
        counted = cut(gw)
        assert counted["too_many_connections"] == 1 and counted["head_timeout"] == 4


def test_the_limits_are_settings() -> None:
    config = GatewayConfig.model_validate(apply_env(
        {"models": [{"name": "m", "upstream": "http://127.0.0.1:1"}]},
        {"SLUICE_TIMEOUTS__REQUEST_READ_S": "2.5", "SLUICE_LISTEN__MAX_CONNECTIONS": "100",
         "SLUICE_TIMEOUTS__BODY_MIN_BYTES_PER_S": "4096"}))
    assert config.connection_limits() == ConnectionLimits(
        request_read_s=2.5, body_min_bytes_per_s=4096, max_connections=100)
    assert GatewayConfig.model_validate(
        {"models": [{"name": "m", "upstream": "http://127.0.0.1:1"}]}
    ).connection_limits() == ConnectionLimits()  # the documented defaults
    for bad in ({"timeouts": {"request_read_s": 0}}, {"timeouts": {"request_read_s": "inf"}},
                {"timeouts": {"body_min_bytes_per_s": 0}}, {"listen": {"max_connections": 0}}):
        with pytest.raises(ValidationError):
            GatewayConfig.model_validate(
                {**bad, "models": [{"name": "m", "upstream": "http://127.0.0.1:1"}]})


def test_sluice_gateway_serves_with_the_limits_of_its_yaml(fake: FakeBackend,
                                                           tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "tenants.yaml").write_text(yaml.safe_dump({"tenants": [
        {"id": "one", "keys": [hash_key(TEST_KEY)]}]}))
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump({
        "listen": {"port": port, "max_connections": 2}, "tenants_file": "tenants.yaml",
        "timeouts": {"request_read_s": 1.0},
        "models": [{"name": "m", "upstream": fake.url, "kind": "sluice",
                    "upstream_model": fake.name, "tokenizer": "bytes"}]}))
    log = tmp_path / "gateway.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sluice.cli", "gateway", "--config",
                                 str(tmp_path / "gateway.yaml"), "--log-level", "warning"],
                                cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(url + "/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, "sluice gateway ready")
        slow = [connect(port) for _ in range(2)]
        for sock in slow:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\n")
        refused = request(port, b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert refused.status == 503, "the cap of the YAML file applies"
        answers = [trickle(sock, b"") for sock in slow]
        assert [a.status for a in answers] == [408, 408]
        wait_until(lambda: httpx.get(url + "/v1/models", headers=auth(),
                                     timeout=5).status_code == 200, "served again")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
