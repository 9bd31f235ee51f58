"""A ``redis-server`` child process for the benches (``policies.bench_release``,
``gateway.bench_tenants``): a free 127.0.0.1 port, no persistence, ready when it answers PING,
stopped by its PID. Nothing on the request path imports this."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class RedisChild:
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        stop_by_pid(self.proc)


def stop_by_pid(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 10 s; only this child, by its PID."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextmanager
def redis_child(prefix: str = "sluice-redis-") -> Iterator[RedisChild]:
    """Start one, yield it once it answers, stop it (and remove its directory) on the way out."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    with tempfile.TemporaryDirectory(prefix=prefix) as workdir:
        port = free_port()
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1",
                                 "--save", "", "--appendonly", "no", "--dir", workdir],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        child = RedisChild(port, proc)
        try:
            deadline = time.monotonic() + 10
            while not _answers_ping(port):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"redis-server on port {port} did not start")
                time.sleep(0.02)
            yield child
        finally:
            child.stop()
