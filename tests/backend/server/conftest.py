"""Real `sluice backend --model tiny` servers on free 127.0.0.1 ports, stopped by PID."""

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

    @property
    def pid(self) -> int:
        return self.proc.pid

    def state(self) -> dict:
        return httpx.get(self.url + "/v1/state", timeout=5).json()

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


def start_backend(tmp_dir: Path, *extra: str, ready_timeout: float = 120.0) -> Backend:
    port = free_port()
    log_path = tmp_dir / f"backend-{port}.log"
    cmd = [sys.executable, "-m", "sluice.cli", "backend", "--model", "tiny",
           "--port", str(port), "--log-level", "warning", *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    backend = Backend(f"http://127.0.0.1:{port}", port, proc, log_path)
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
