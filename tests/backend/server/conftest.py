"""Real `sluice backend --model tiny` servers on free 127.0.0.1 ports, stopped by PID.

They serve without an API key (``--no-api-key``) unless given one: these tests are about
the backend's API, and test_auth.py about its key. Where a gateway sits in front, the
backend gets a key, passed the way production passes it (``$SLUICE_BACKEND_API_KEY``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
BACKEND_KEY_ENV = "SLUICE_BACKEND_API_KEY"
BACKEND_KEY = "sk-test-backend-key"  # the key of the backends that tests put a gateway before
# where an in-process gateway (and a `sluice gateway` child) reads it: a model's api_key_env
GATEWAY_KEY_ENV = "SLUICE_TEST_BACKEND_KEY"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Backend:
    url: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    api_key: str | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def headers(self) -> dict[str, str]:
        """What a request needs to be let in."""
        return {} if self.api_key is None else {"authorization": f"Bearer {self.api_key}"}

    def state(self) -> dict:
        return httpx.get(self.url + "/v1/state", headers=self.headers, timeout=5).json()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM by PID, then SIGKILL if it lingers; returns the exit code."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return int(self.proc.returncode)


def backend_env(api_key: str | None) -> dict[str, str]:
    """The environment of a `sluice backend` child: the key in its variable, if any."""
    env = {k: v for k, v in os.environ.items() if k != BACKEND_KEY_ENV}
    env["PYTHONPATH"] = str(REPO_ROOT)
    if api_key is not None:
        env[BACKEND_KEY_ENV] = api_key
    return env


def start_backend(tmp_dir: Path, *extra: str, ready_timeout: float = 120.0,
                  api_key: str | None = None) -> Backend:
    port = free_port()
    log_path = tmp_dir / f"backend-{port}.log"
    cmd = [sys.executable, "-m", "sluice.cli", "backend", "--model", "tiny",
           "--port", str(port), "--log-level", "warning", *extra]
    if api_key is None:
        cmd.append("--no-api-key")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env=backend_env(api_key))
    backend = Backend(f"http://127.0.0.1:{port}", port, proc, log_path, api_key)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"backend exited with {proc.returncode}:\n{backend.log()}")
        try:
            if httpx.get(backend.url + "/health", timeout=1).status_code == 200:
                return backend
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    backend.stop()
    raise RuntimeError(f"backend not ready in {ready_timeout}s:\n{backend.log()}")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """Build the tiny checkpoint once, before any server races to build it."""
    from modelfiles.tiny_model import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def backend(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    """One default server shared by the modules that do not need special flags."""
    b = start_backend(tmp_path_factory.mktemp("backend"))
    yield b
    b.stop()
