"""Fault injection on 127.0.0.1: real `sluice backend --model tiny` replicas that tests
SIGKILL, SIGSTOP and restart by PID (on the same port), a gateway pool in front of them (in
a uvicorn thread, so tests can read its state), raw-socket clients, and the leak check that
every scenario ends with."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import httpx
import pytest

from gateway.config import (
    BreakerConfig,
    GatewayConfig,
    Listen,
    ModelEntry,
    ResilienceConfig,
    RetryConfig,
    Timeouts,
)
from tests.backend.server.conftest import (
    BACKEND_KEY,
    GATEWAY_KEY_ENV,
    REPO_ROOT,
    backend_env,
    free_port,
)
from tests.gateway.conftest import TEST_KEY, ThreadedGateway, auth

__all__ = ["TEST_KEY", "Replica", "ThreadedGateway", "assert_no_leaks", "auth", "pool_config",
           "stream_chat"]


SLOW = ("--fault-step-delay", "3")


class Replica:
    """A bundled backend on a fixed port: killed, paused and restarted by PID."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmp = tmp
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        log = open(self.tmp / f"backend-{self.port}.log", "ab")  # noqa: SIM115
        with log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sluice.cli", "backend", "--model", "tiny", "--port",
                 str(self.port), "--log-level", "warning", "--seed", "0", *self.extra],
                cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                env=backend_env(BACKEND_KEY))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"backend exited with {self.proc.returncode}"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"backend on {self.port} not ready in {timeout} s")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def state(self) -> dict[str, Any]:
        return httpx.get(self.url + "/v1/state", timeout=5,
                         headers={"authorization": f"Bearer {BACKEND_KEY}"}).json()


@pytest.fixture(scope="package")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    """Two tiny backends for the package (a test that kills one restarts it).

    Each engine step takes at least 3 ms (``--fault-step-delay``), so that a long answer
    (1900 tokens: 5.7 s or more) outlasts the gateway's stall and shutdown timeouts on any
    machine: the tiny model alone makes ~4,000 tokens/s for one stream on the dev box."""
    from modelfiles.tiny_model import ensure_tiny_model

    ensure_tiny_model()
    tmp = tmp_path_factory.mktemp("replicas")
    pair = [Replica(tmp, *SLOW), Replica(tmp, *SLOW)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(GATEWAY_KEY_ENV, BACKEND_KEY)  # what the gateways send them (api_key_env)
        for r in pair:
            r.start()
        yield pair
        for r in pair:
            r.stop()


def pool_config(urls: list[str], *, solo: str | None = None, store_url: str | None = None,
                send_buffer_bytes: int | None = None, **timeouts: Any) -> GatewayConfig:
    """Model "m" on the pool; "solo" on one server alone (no other to retry on)."""
    models = [ModelEntry(name="m", upstreams=urls, kind="sluice",  # type: ignore[arg-type]
                         upstream_model="sluice-tiny", tokenizer="local:tiny",
                         api_key_env=GATEWAY_KEY_ENV)]
    if solo is not None:
        models.append(ModelEntry(name="solo", upstream=solo, kind="sluice",
                                 upstream_model="sluice-tiny", tokenizer="local:tiny",
                                 api_key_env=GATEWAY_KEY_ENV))
    from gateway.config import AdmissionConfig, StoreConfig

    return GatewayConfig(
        listen=Listen(port=free_port(), send_buffer_bytes=send_buffer_bytes),
        refresh_interval_s=3600, models=models,
        timeouts=Timeouts(**{"connect_s": 1.0, "read_s": 30.0, **timeouts}),
        store=StoreConfig(url=store_url, timeout_s=0.1),
        admission=AdmissionConfig(lease_ttl_s=3.0),
        resilience=ResilienceConfig(
            breaker=BreakerConfig(consecutive_failures=2, cooldown_s=1.0),
            retry=RetryConfig(budget_ratio=1.0, backoff_base_s=0.001)))


def chat(max_tokens: int, model: str = "m", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "tell me a story"}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True, **extra}


class StreamClient(threading.Thread):
    """One streamed request, read as it arrives: its events and when each came."""

    def __init__(self, url: str, body: dict[str, Any], key: str = TEST_KEY) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.key = url, body, key
        self.status = 0
        self.events: list[tuple[float, Any]] = []
        self.headers: dict[str, str] = {}
        self.first = threading.Event()
        self.failed: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=self.body,
                              headers=auth(self.key), timeout=60) as resp:
                self.status = resp.status_code
                self.headers = dict(resp.headers)
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        self.events.append((time.monotonic(), data if data == "[DONE]"
                                            else json.loads(data)))
                        self.first.set()
                if resp.status_code != 200:
                    self.events.append((time.monotonic(), json.loads(resp.read() or b"{}")))
        except BaseException as exc:  # noqa: BLE001  # reported by the test
            self.failed = exc
        finally:
            self.first.set()

    @property
    def error(self) -> dict[str, Any] | None:
        for _, e in self.events:
            if isinstance(e, dict) and "error" in e:
                return e["error"]  # type: ignore[no-any-return]
        return None


def stream_chat(url: str, body: dict[str, Any]) -> StreamClient:
    c = StreamClient(url, body)
    c.start()
    return c


def member_of(gw: ThreadedGateway, replica: Replica) -> Any:
    return next(m for m in gw.gateway.upstreams["m"].members if m.url == replica.url)


def tasks(gw: ThreadedGateway) -> int:
    import asyncio

    async def count() -> int:
        return len(asyncio.all_tasks())

    return int(gw.call(count()))


def assert_no_leaks(gw: ThreadedGateway, replicas: list[Replica], idle_tasks: int,
                    redis_url: str | None = None, timeout: float = 10.0) -> None:
    """Nothing held anywhere once the scenario is over (polled: releases are async)."""
    deadline = time.monotonic() + timeout
    while True:
        problems = _leaks(gw, replicas, idle_tasks, redis_url)
        if not problems:
            return
        if time.monotonic() > deadline:
            raise AssertionError("leaks: " + "; ".join(problems))
        time.sleep(0.05)


def _leaks(gw: ThreadedGateway, replicas: list[Replica], idle_tasks: int,
           redis_url: str | None) -> list[str]:
    g = gw.gateway
    out = []
    if g.metrics.inflight:
        out.append(f"{g.metrics.inflight} requests in flight")
    if g.admission.live:
        out.append(f"leases {list(g.admission.live)}")
    for name, q in g.queues.items():
        if q.snapshot().slots_held or q.size:
            out.append(f"queue {name}: {q.snapshot().slots_held} slots, {q.size} waiting")
    for up in g.upstreams.values():
        for m in up.members:
            if m.pool.active or m.inflight_tokens or m.inflight_requests or m.breaker.probes:
                out.append(f"{m.url}: {m.pool.active} connections lent, {m.inflight_tokens} "
                           f"tokens, {m.breaker.probes} probes")
    n = tasks(gw)
    if n > idle_tasks:
        out.append(f"{n} asyncio tasks (idle: {idle_tasks})")
    for r in replicas:
        s = r.state()
        if s["running"] or s["waiting"] or s["kv_blocks_free"] != s["kv_blocks_total"]:
            out.append(f"backend {r.port}: running {s['running']}, waiting {s['waiting']}, "
                       f"free {s['kv_blocks_free']}/{s['kv_blocks_total']}")
    if redis_url is not None:
        import redis

        with redis.Redis.from_url(redis_url) as r:
            for key in r.scan_iter("*"):
                kind = r.type(key)
                if kind == b"zset" and not key.endswith(b":done") and r.zcard(key):
                    out.append(f"redis {key!r}: {r.zcard(key)} live")
                if key.endswith(b":resv") and r.hlen(key):
                    out.append(f"redis {key!r}: {r.hlen(key)} reservations")
    return out


def raw_stream_socket(port: int, body: dict[str, Any], rcvbuf: int = 4096) -> socket.socket:
    """A client that sends a streamed request and then never reads (a slowloris)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
              b"authorization: Bearer " + TEST_KEY.encode() + b"\r\n"
              b"content-type: application/json\r\ncontent-length: "
              + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return s


class DelayProxy:
    """A TCP proxy (127.0.0.1) that holds every chunk from the server for ``delay`` s
    before passing it on: a slow Redis, not a dead one. Runs its own loop in a thread."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.delay = 0.0
        self.loop: Any = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import asyncio

        self.loop = asyncio.new_event_loop()
        server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", self.port))
        self._stop = self.loop.create_future()
        self._ready.set()
        self.loop.run_until_complete(self._stop)
        server.close()
        self.loop.run_until_complete(server.wait_closed())
        self.loop.close()

    async def _serve(self, reader: Any, writer: Any) -> None:
        import asyncio

        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(src: Any, dst: Any, delayed: bool) -> None:
            try:
                while data := await src.read(65536):
                    if delayed and self.delay:
                        await asyncio.sleep(self.delay)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_w, False), pipe(up_r, writer, True))

    def __enter__(self) -> Self:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self._stop.set_result, None)
        self._thread.join(10)
