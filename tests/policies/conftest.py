"""Stores for the shared suite: MemoryStore on a fake clock, RedisStore on a real server,
and RedisStore on a real Redis Cluster (3 masters + 3 replicas, tests/cluster.py).

One `redis-server` (no persistence) runs per session on a free 127.0.0.1 port and is
stopped by PID, and so does one cluster; every test gets its own key prefix, so tests never
see each other's keys (on the cluster, the tenant's hash tag picks the master).
`Harness.advance` steps the fake clock, or sleeps for real on Redis (whose clock is TIME
and cannot be faked): time-dependent tests keep such waits short and compare waits with
bounds that allow for the real time that passed.
"""

from __future__ import annotations

import asyncio
import calendar
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from redis.asyncio import Redis

from policies.memory import MemoryStore
from policies.redis_child import stop_by_pid
from policies.redis_store import RedisStore
from policies.store import Store
from tests.backend.server.conftest import free_port
from tests.cluster import redis_cluster

__all__ = ["redis_cluster"]  # the session's cluster fixture, for this package's tests

#: Slack for waits measured against Redis: rounding, a scheduling hiccup. A bound, not a target.
TOL = 0.05
NOON = calendar.timegm((2025, 3, 14, 12, 0, 0))  # the fake clock's start, UTC


class RedisServer:
    """A `redis-server` child process, stopped, paused and restarted by PID."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (`make test` installs it)")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(self._workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            stop_by_pid(self.proc)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: connections still open, nothing answers (a hung server)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@dataclass
class FakeClock:
    now: float = float(NOON)

    def __call__(self) -> float:
        return self.now


@dataclass
class Harness:
    """One store under test, plus what the shared suite needs to drive time."""

    kind: str                              # "memory" | "redis" | "cluster"
    store: Store
    advance: Callable[[float], Awaitable[None]]
    server_time: Callable[[], Awaitable[float]]  # the store's clock, epoch seconds
    clock: FakeClock | None = None         # memory only
    replica: Callable[[], Awaitable[Store]] | None = None  # redis: another pool, same data
    _owned: list[Store] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return self.kind == "memory"

    def expect_wait(self, actual: float | None, expected: float, elapsed: float) -> None:
        """`actual` is the `expected` wait, less up to `elapsed` real seconds (Redis)."""
        assert actual is not None
        if self.exact:
            assert actual == pytest.approx(expected, abs=1e-6)
        else:
            assert expected - elapsed - TOL <= actual <= expected + TOL


def memory_harness() -> Harness:
    clock = FakeClock()

    async def step(seconds: float) -> None:
        clock.now += seconds

    async def fake_time() -> float:
        return clock.now

    return Harness("memory", MemoryStore(clock), step, fake_time, clock=clock)


@pytest.fixture
def memory() -> Harness:
    """The MemoryStore alone, for what only a fake clock can show (a microsecond, 23:59)."""
    return memory_harness()


@pytest.fixture(params=["memory", "redis", "cluster"])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    if request.param == "memory":
        yield memory_harness()
        return

    cluster = request.param == "cluster"
    if cluster:
        url = request.getfixturevalue("redis_cluster").url
    else:
        url = request.getfixturevalue("redis_server").url
    prefix = f"t{uuid.uuid4().hex[:12]}"
    raw = Redis.from_url(url)  # TIME: any node (one host, one clock)
    owned: list[Store] = []

    async def replica() -> Store:
        # A roomy timeout: this suite checks the contract, not latency, and a loaded CI
        # host can stall ~100 fresh connections past 0.25 s. Timeouts: test_redis_store.py.
        store = RedisStore(url, key_prefix=prefix, timeout_s=2.0, cluster=cluster)
        owned.append(store)
        return store

    async def redis_time() -> float:
        sec, usec = await raw.time()
        return sec + usec / 1e6

    h = Harness(request.param, await replica(), asyncio.sleep, redis_time, replica=replica,
                _owned=owned)
    yield h
    for store in owned:
        await store.close()
    await raw.aclose()


async def eventually(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Poll ``check`` every 5 ms until it holds; fail with ``what`` after ``timeout`` s."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not check():
        if loop.time() > end:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.005)
