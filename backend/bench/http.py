"""`--http` benchmark: one mixed streaming workload driven on the engine directly and
through the HTTP server (a real `sluice backend` subprocess), side by side in one run.

Reports ``http_over_direct_tokens_per_s``: output tokens/s through HTTP over tokens/s of
the engine driven directly through its Python API, and the same against the engine's bare
step loop (``http_over_engine_loop_tokens_per_s``). The workload is closed-loop (a fixed number of
concurrent clients, each sending its next request when the previous one ends), with mixed
prompt and output lengths, a shared prefix for part of the requests, greedy decoding and
ignore_eos, so all sides generate exactly the same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self, cast

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(slots=True, frozen=True)
class Job:
    prompt: list[int]
    max_tokens: int


def make_workload(n: int, seed: int = 7, vocab: int = 1000) -> list[Job]:
    """Mixed lengths; a third share a 64-token prefix (as chat turns share a system prompt)."""
    rng = random.Random(seed)
    shared = [rng.randrange(4, vocab) for _ in range(64)]
    jobs = []
    for i in range(n):
        plen = rng.choice((8, 24, 64, 160))
        body = [rng.randrange(4, vocab) for _ in range(plen)]
        prompt = shared + body if i % 3 == 0 else body
        jobs.append(Job(prompt, rng.choice((16, 48, 96, 160))))
    return jobs


async def _closed_loop(jobs: list[Job], concurrency: int, one: Any) -> tuple[int, float]:
    queue: list[Job] = list(reversed(jobs))
    total = 0

    async def worker() -> None:
        nonlocal total
        while queue:
            job = queue.pop()
            n = await one(job)  # not `total += await …`: that reads total before the await
            total += n

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return total, time.perf_counter() - t0


class LoopSide:
    """The workload on the engine driven directly: ``LLMEngine.step()`` in a plain loop on
    one thread, no asyncio and no hand-off between threads: the engine's own ceiling."""

    def __init__(self) -> None:
        from backend.engine.builder import build_engine
        from backend.engine.config import EngineConfig

        self.core = build_engine(EngineConfig(model="tiny")).core
        self._ids = iter(range(10**9))

    def run(self, jobs: list[Job], concurrency: int) -> tuple[int, float]:
        """Closed loop, as the HTTP side's clients: a job starts when another ends."""
        from backend.engine.sampling import SamplingParams

        core = self.core
        pending = list(reversed(jobs))

        def start() -> None:
            job = pending.pop()
            params = SamplingParams(max_tokens=job.max_tokens, temperature=0.0,
                                    ignore_eos=True)
            core.add_request(f"d{next(self._ids)}", job.prompt, params)

        total = active = 0
        t0 = time.perf_counter()
        while pending and active < concurrency:
            start()
            active += 1
        while active:
            for delta in core.step():
                if delta.finished:
                    total += delta.num_output_tokens
                    active -= 1
                    if pending:
                        start()
                        active += 1
        return total, time.perf_counter() - t0


class ApiSide:
    """The workload through the engine's Python API, no HTTP: an ``AsyncEngine`` over a
    ``ProcessTransport`` (the engine in a process of its own, set up as ``sluice backend``
    sets it up) driven by asyncio tasks in this process."""

    async def __aenter__(self) -> Self:
        from backend.engine.async_engine import AsyncEngine
        from backend.engine.config import EngineConfig
        from backend.engine.process_transport import ProcessTransport

        transport = await asyncio.to_thread(
            ProcessTransport.from_config, EngineConfig(model="tiny", reserve_cores=1))
        self.engine = AsyncEngine(transport)
        await self.engine.start()
        self._ids = iter(range(10**9))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.engine.shutdown()

    async def one(self, job: Job) -> int:
        from backend.engine.sampling import SamplingParams

        params = SamplingParams(max_tokens=job.max_tokens, temperature=0.0, ignore_eos=True)
        stream = await self.engine.generate(f"a{next(self._ids)}", job.prompt, params)
        n = 0
        async for delta in stream:
            n = delta.num_output_tokens
        return n


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Connection(asyncio.Protocol):
    """A minimal keep-alive HTTP/1.1 client connection for the load side.

    The bench measures the server, and its client shares the machine's cores with it (two
    on the reference box), so the client does as little as it can per token: a protocol
    callback that keeps the body's last 1 KiB, with no parsing and no task woken per chunk
    (an httpx client, or even an ``asyncio.StreamReader``, costs the server's cores more per
    token than the server's own Python work does).
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self._done: asyncio.Future[bytes] | None = None
        self._head: bytes | None = None  # the response head, once complete
        self._buf = b""  # the head so far, then the body's last 1 KiB

    @classmethod
    async def open(cls, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(cls, host, port)
        return conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._done is not None and not self._done.done():
            self._done.set_exception(
                RuntimeError("the server closed the connection mid-response") if self._head
                else ConnectionResetError("the server closed the connection"))

    def data_received(self, data: bytes) -> None:
        if self._done is None or self._done.done():
            return
        if self._head is None:
            self._buf += data
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                return
            self._head, data, self._buf = self._buf[:end + 4], self._buf[end + 4:], b""
            if not self._head.startswith(b"HTTP/1.1 200"):
                status = self._head.split(b"\r\n", 1)[0]
                self._done.set_exception(RuntimeError(f"server answered {status!r}"))
                return
            if b"chunked" not in self._head.lower():
                self._done.set_exception(RuntimeError("expected a chunked (streamed) response"))
                return
        self._buf = (self._buf + data)[-1024:]
        if self._buf.endswith(b"0\r\n\r\n"):
            self._done.set_result(self._buf)

    async def post_stream(self, request: bytes) -> bytes:
        """Send a whole request and read its chunked response; returns the body's last
        1 KiB. Raises ConnectionResetError if the server closes the connection before it
        answers (an idle keep-alive connection it timed out), RuntimeError on any other failure."""
        if self.transport is None or self.lost:
            raise ConnectionResetError("the connection is closed")
        self._head, self._buf = None, b""
        self._done = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return await self._done

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class HttpSide:
    """The workload through a `sluice backend --model tiny` subprocess, streamed over SSE."""

    def __init__(self, concurrency: int, *server_flags: str) -> None:
        self.concurrency = concurrency
        self.server_flags = server_flags
        self.idle: list[_Connection] = []
        self.key = secrets.token_urlsafe(24)  # the server's API key, as the gateway sends it

    async def __aenter__(self) -> Self:
        import httpx

        self.port = _free_port()
        self.proc = subprocess.Popen(  # noqa: ASYNC220 - once per run, before measuring
            [sys.executable, "-m", "sluice.cli", "backend", "--model", "tiny",
             "--port", str(self.port), "--log-level", "warning", *self.server_flags],
            cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT),
                 "SLUICE_BACKEND_API_KEY": self.key})
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.port}") as client:
                await _wait_ready(client, self.proc)
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        for conn in self.idle:
            conn.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    async def one(self, job: Job) -> int:
        body = json.dumps({"prompt": job.prompt, "max_tokens": job.max_tokens, "stream": True,
                           "temperature": 0, "ignore_eos": True,
                           "stream_options": {"include_usage": True}}).encode()
        request = (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                   b"authorization: Bearer %s\r\n"
                   b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                   % (self.key.encode(), len(body), body))
        while True:
            conn = self.idle.pop() if self.idle else None
            if conn is not None and conn.lost:  # the server closed an idle keep-alive one
                continue
            fresh = conn is None
            if conn is None:
                conn = await _Connection.open("127.0.0.1", self.port)
            try:
                tail = await conn.post_stream(request)
                break
            except ConnectionResetError:
                conn.close()
                if fresh:  # not a stale keep-alive connection: a real failure
                    raise
            except BaseException:
                conn.close()  # mid-answer: not reusable
                raise
        self.idle.append(conn)
        usage = tail.rsplit(b"data: ", 2)[-2]  # the usage event, just before [DONE]
        event = json.loads(usage.split(b"\r\n", 1)[0])
        if "usage" not in event:
            raise RuntimeError(f"the stream did not end with usage: {tail[-300:]!r}")
        return int(event["usage"]["completion_tokens"])


async def _wait_ready(client: Any, proc: subprocess.Popen[bytes]) -> None:
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise RuntimeError(f"the server exited: {err[-2000:]}")
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.HTTPError:  # not listening yet
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError("the server did not become ready")


async def run_http_bench(quick: bool) -> dict[str, float]:
    """Tokens/s of the workload on each side and their ratios.

    Sides:
    - ``engine_loop``: ``LLMEngine.step()`` in a bare loop in this process, the engine's
      ceiling (no asyncio, no process boundary, no HTTP);
    - ``direct``: the engine driven directly through its Python API, an ``AsyncEngine``
      over a ``ProcessTransport`` set up as the server sets it up (engine process, one core left to the caller), driven
      by asyncio tasks: the server minus HTTP;
    - ``http``: the server as shipped, over SSE;
    - ``http_in_process``: the server with ``--engine-in-process`` (the step loop on a
      thread of the server's process, the layout before the engine process).

    ``http_over_direct_tokens_per_s`` is the cost of HTTP; ``http_over_engine_loop`` is the
    cost of the whole serving path (engine API, process hop, HTTP) against the engine's
    bare loop. Each round runs every side once, in a rotating order, and each ratio is the
    median over rounds of that round's ratio: a pair is seconds apart, so drifts in the
    machine's speed (large on a shared two-core VM) cancel in each pair. The bare loop gets
    its best thread count: before the rounds it runs with torch's default and with the
    server's, and keeps the faster.
    """
    import statistics

    import torch

    from backend.engine.builder import cpu_threads
    from backend.engine.config import EngineConfig

    n, concurrency, rounds = (48, 16, 3) if quick else (128, 24, 8)
    jobs = make_workload(n)
    warmup = make_workload(concurrency, seed=99)
    default_threads = torch.get_num_threads()
    server_threads = cpu_threads(EngineConfig(reserve_cores=1), torch.device("cpu"))
    thread_counts = sorted({default_threads, server_threads or default_threads})
    tokens: set[int] = set()
    loop_side = LoopSide()
    per_threads: dict[int, float] = {}
    for t in thread_counts:
        torch.set_num_threads(t)
        loop_side.run(warmup, concurrency)
        for _ in range(2):
            count, seconds = loop_side.run(jobs, concurrency)
            tokens.add(count)
            per_threads[t] = max(per_threads.get(t, 0.0), count / seconds)
    loop_threads = max(per_threads, key=lambda t: per_threads[t])
    torch.set_num_threads(loop_threads)
    names = ["engine_loop", "direct", "http", "http_in_process"]
    rates: dict[str, list[float]] = {name: [] for name in names}
    async with (ApiSide() as direct, HttpSide(concurrency) as http,
                HttpSide(concurrency, "--engine-in-process") as in_process):
        sides: dict[str, ApiSide | HttpSide] = {"direct": direct, "http": http,
                                                "http_in_process": in_process}
        for side in sides.values():
            await _closed_loop(warmup, concurrency, side.one)
        for r in range(rounds):
            for name in names[r % 4:] + names[:r % 4]:
                if name in sides:
                    count, seconds = await _closed_loop(jobs, concurrency, sides[name].one)
                else:  # blocks the event loop, which has nothing else to do meanwhile
                    count, seconds = loop_side.run(jobs, concurrency)
                tokens.add(count)
                rates[name].append(count / seconds)
    torch.set_num_threads(default_threads)
    if len(tokens) != 1:
        raise RuntimeError(f"the sides generated different token counts: {sorted(tokens)}")

    def ratios(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(rates[a], rates[b])]

    result = {name + "_tokens_per_s": round(statistics.median(rates[name]), 1)
              for name in names}
    for a, b in (("http", "direct"), ("http", "engine_loop"), ("direct", "engine_loop"),
                 ("http_in_process", "engine_loop"), ("http", "http_in_process")):
        result[f"{a}_over_{b}_tokens_per_s"] = round(statistics.median(ratios(a, b)), 3)
    result["http_over_direct_min"] = round(min(ratios("http", "direct")), 3)
    result["http_over_direct_max"] = round(max(ratios("http", "direct")), 3)
    result["rounds"] = float(rounds)
    result["engine_loop_cpu_threads"] = float(loop_threads)
    result["http_server_cpu_threads"] = float(server_threads or default_threads)
    for t in thread_counts:
        result[f"engine_loop_tokens_per_s_{t}_threads"] = round(per_threads[t], 1)
    return result


def run_loop_factory() -> Any:
    """uvloop when installed, as the server itself uses (uvicorn's loop="auto")."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: list[str] | None = None) -> int:
    """``python -m backend.bench.http [--quick]``: the figures as JSON on stdout."""
    ap = argparse.ArgumentParser(prog="python -m backend.bench.http", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="48 requests, 16 clients, 3 rounds (default: 128, 24, 8)")
    args = ap.parse_args(argv)
    with asyncio.Runner(loop_factory=run_loop_factory()) as runner:
        result = runner.run(run_http_bench(args.quick))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
