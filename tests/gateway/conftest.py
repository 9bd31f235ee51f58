"""Gateways for the tests: `sluice up` as a real process, or the app in a uvicorn thread.

``sluice up`` (bundled tiny backend + gateway, two processes) is started once per session on
free 127.0.0.1 ports and stopped by PID. ``ThreadedGateway`` runs the gateway app in-process
on a real socket, in front of whatever upstream a test builds (a real server or an httpx
transport), so tests can reach into its state.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import httpx
import pytest
import uvicorn

from gateway.app import create_app
from gateway.config import GatewayConfig, TenantsFile
from protocol.limits import ConnectionCounts
from protocol.server import http_protocol
from tests.backend.server.conftest import BACKEND_KEY, backend_env, free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
ALPHA = "sk-demo-alpha"
BETA = "sk-demo-beta"


@dataclass
class SluiceUp:
    url: str  # the gateway
    backend_url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    backend_key: str | None = None  # None: `sluice up` made one and kept it to itself

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def backend_headers(self) -> dict[str, str]:
        """What a request straight to the bundled backend needs."""
        return {} if self.backend_key is None else {
            "authorization": f"Bearer {self.backend_key}"}

    def backend_state(self) -> dict[str, Any]:
        return httpx.get(self.backend_url + "/v1/state", headers=self.backend_headers,
                         timeout=5).json()

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5).text

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return int(self.proc.returncode)


def start_sluice_up(tmp_dir: Path, *extra: str, timeout: float = 180.0,
                    backend_key: str | None = BACKEND_KEY) -> SluiceUp:
    """`sluice up` with ``backend_key`` in $SLUICE_BACKEND_API_KEY (so that tests can read
    the backend's state); None: `sluice up` makes the key itself, as it does by default."""
    port, backend_port = free_port(), free_port()
    log_path = tmp_dir / f"up-{port}.log"
    cmd = [sys.executable, "-m", "sluice.cli", "up", "--port", str(port),
           "--backend-port", str(backend_port), "--log-level", "warning", *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env=backend_env(backend_key))
    up = SluiceUp(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{backend_port}", proc,
                  log_path, backend_key)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sluice up exited with {proc.returncode}:\n{up.log()}")
        if "sluice is up" in up.log():
            return up
        time.sleep(0.1)
    up.stop()
    raise RuntimeError(f"sluice up not ready in {timeout}s:\n{up.log()}")


@pytest.fixture(scope="session")
def sluice_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceUp]:
    from modelfiles.tiny_model import ensure_tiny_model

    ensure_tiny_model()  # built once, before the backend and the gateway race to build it
    up = start_sluice_up(tmp_path_factory.mktemp("up"))
    yield up
    up.stop()


class ThreadedGateway:
    """The gateway app on a real 127.0.0.1 socket, served by uvicorn in a thread."""

    def __init__(self, config: GatewayConfig, tenants: TenantsFile,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.port = config.listen.port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        counts = ConnectionCounts()
        self.app = create_app(config, tenants, transport=transport, connections=counts)
        self.server = uvicorn.Server(uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning",
            lifespan="on", timeout_graceful_shutdown=5,
            http=http_protocol(config.connection_limits(), counts)))  # as `sluice gateway`
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.send_buffer_bytes = config.listen.send_buffer_bytes

    def _run(self) -> None:
        import uvloop  # the loop `sluice gateway` runs on

        from gateway.cli import listen_socket

        self.loop = uvloop.new_event_loop()
        sockets = None if self.send_buffer_bytes is None else [
            listen_socket("127.0.0.1", self.port, self.send_buffer_bytes)]
        self.loop.run_until_complete(self.server.serve(sockets=sockets))

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the threaded gateway did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)

    @property
    def gateway(self) -> Any:
        return self.app.state.gateway

    def call(self, coro: Any, timeout: float = 10) -> Any:
        """Run a coroutine on the gateway's loop (to touch its state safely)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


TEST_KEY = "sk-test-one"
OTHER_KEY = "sk-test-two"


def tenants_for_tests(**caps: Any) -> TenantsFile:
    from gateway.config import Caps, PriorityRange, TenantEntry
    from gateway.tenants import hash_key

    return TenantsFile(tenants=[
        TenantEntry(id="one", keys=[hash_key(TEST_KEY)], models=["*"],
                    priority=PriorityRange(min=0, max=10, default=4), caps=Caps(**caps)),
        TenantEntry(id="two", keys=[hash_key(OTHER_KEY)], models=["nothing-here"]),
    ])


def config_for(upstream_url: str, *, kind: str = "sluice", tokenizer: str = "upstream",
               name: str = "m", upstream_model: str | None = "fake-model",
               **extra: Any) -> GatewayConfig:
    from gateway.config import Listen, ModelEntry

    entry = ModelEntry(name=name, upstream=upstream_url, kind=kind,  # type: ignore[arg-type]
                       tokenizer=tokenizer, upstream_model=upstream_model,
                       **extra)
    return GatewayConfig(listen=Listen(port=free_port()), models=[entry],
                         refresh_interval_s=3600)


def auth(key: str = TEST_KEY) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}
