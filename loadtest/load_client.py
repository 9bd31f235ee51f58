"""An open-loop HTTP/1.1 load client that costs as little CPU as it can.

The client shares two cores with the servers it measures, so its own work per request is
part of the noise: it runs no task per request, writes pre-built request bytes on pooled
keep-alive connections (raw asyncio `Protocol`s), parses responses with httptools, and
stamps each response when its bytes arrive (`data_received`), before anything else runs.
Bodies are kept and checked after the timed window (`check_stream`), not during it.

Open loop: request *i* is due at ``start + i / rate`` whatever happened to the earlier ones,
so a slow server builds a queue (as real traffic does) instead of slowing the client down.
How late each request actually left (`Sample.lag`) says whether the client kept its
schedule; a lagging client under-loads the server and the step is not to be trusted.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import httptools

REQUEST_TIMEOUT_S = 10.0


@dataclass(slots=True)
class Sample:
    """One request's timeline, in `time.perf_counter()` seconds."""

    due: float
    sent: float = 0.0
    first: float = 0.0  # the first body bytes that carry a token
    done: float = 0.0
    status: int = 0
    body: bytes = b""
    error: str = ""

    @property
    def e2e(self) -> float:
        return self.done - self.sent

    @property
    def ttft(self) -> float:
        return self.first - self.sent

    @property
    def lag(self) -> float:
        return max(0.0, self.sent - self.due)


def check_stream(sample: Sample, want_chunks: int) -> str:
    """'' when the sample is a complete SSE stream of `want_chunks` content chunks + [DONE]."""
    if sample.error:
        return sample.error
    if sample.status != 200:
        return f"HTTP {sample.status}"
    payloads = [line[5:].strip() for line in sample.body.replace(b"\r\n", b"\n").split(b"\n")
                if line.startswith(b"data:")]
    if not payloads or payloads[-1] != b"[DONE]":
        return "no [DONE]"
    content = 0
    for payload in payloads[:-1]:
        try:
            choices = json.loads(payload).get("choices") or []
        except ValueError:
            return "bad SSE JSON"
        for choice in choices:
            delta = choice.get("delta") or {}
            if delta.get("content") or choice.get("text"):
                content += 1
    return "" if content == want_chunks else f"{content} content chunks"


class _Conn(asyncio.Protocol):
    """A keep-alive connection carrying one request at a time."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.sample: Sample | None = None
        self.body: list[bytes] = []
        self.now = 0.0
        self.keep_alive = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.pool.lost(self)
        if self.sample is not None:
            self._finish(self.sample.error or "connection lost")

    def data_received(self, data: bytes) -> None:
        self.now = time.perf_counter()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.sample is not None:
                self._finish(f"bad HTTP response: {exc}")
            if self.transport is not None:
                self.transport.abort()

    def on_headers_complete(self) -> None:
        if self.sample is not None:
            self.sample.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        sample = self.sample
        if sample is not None and not sample.first and (b'"content"' in body
                                                        or b'"text"' in body):
            sample.first = self.now
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.sample is not None:
            self.sample.done = self.now
            self.sample.body = b"".join(self.body)
            self._finish("")

    def send(self, sample: Sample, request: bytes) -> None:
        self.sample, self.body = sample, []
        sample.sent = time.perf_counter()
        if self.transport is None:
            self._finish("connection closed")
            return
        self.transport.write(request)

    def abort(self, reason: str) -> None:
        if self.sample is not None:
            self.sample.error = reason
        if self.transport is not None:
            self.transport.abort()

    def _finish(self, error: str) -> None:
        sample, self.sample = self.sample, None
        if sample is None:
            return
        sample.error = error
        reusable = not error and self.keep_alive and self.transport is not None
        if not reusable and self.transport is not None:
            self.transport.abort()
        self.pool.finished(self, sample, reusable)


@dataclass(slots=True)
class Pool:
    """Keep-alive connections to one target, and the requests in flight on them."""

    host: str
    port: int
    request: bytes
    idle: list[_Conn] = field(default_factory=list)
    busy: set[_Conn] = field(default_factory=set)
    done: list[Sample] = field(default_factory=list)
    connecting: int = 0  # connections opened on demand while a run was going
    opened: int = 0
    _drained: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    # closed loop (`closed_loop`): called with the connection that just finished a request
    refill: Callable[[], None] | None = None

    async def warm(self, n: int) -> None:
        """Open connections up to `n` idle ones, before any timed run."""
        while len(self.idle) < n:
            self.idle.append(await self._connect())

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: _Conn(self), self.host, self.port)
        self.opened += 1
        return conn

    def send(self, sample: Sample) -> None:
        self._drained.clear()
        if self.idle:
            conn = self.idle.pop()
            self.busy.add(conn)
            conn.send(sample, self.request)
            return
        # No idle connection: open one off the schedule (counted; warm() should prevent it).
        self.connecting += 1
        task = asyncio.get_running_loop().create_task(self._connect_and_send(sample))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connect_and_send(self, sample: Sample) -> None:
        try:
            conn = await self._connect()
        except OSError as exc:
            sample.sent = sample.done = time.perf_counter()
            sample.error = f"connect: {exc}"
            self.done.append(sample)
            self._maybe_drained()
            return
        self.busy.add(conn)
        conn.send(sample, self.request)

    @property
    def in_flight(self) -> int:
        return len(self.busy) + len(self._tasks)

    def finished(self, conn: _Conn, sample: Sample, reusable: bool) -> None:
        self.busy.discard(conn)
        if reusable:
            self.idle.append(conn)
        self.done.append(sample)
        if self.refill is not None:
            self.refill()  # a lost connection is replaced: send() opens a new one
        self._maybe_drained()

    def lost(self, conn: _Conn) -> None:
        if conn in self.idle:
            self.idle.remove(conn)

    def _maybe_drained(self) -> None:
        if not self.busy and not self._tasks:
            self._drained.set()

    def expire(self, now: float, timeout: float) -> None:
        for conn in list(self.busy):
            if conn.sample is not None and now - conn.sample.sent > timeout:
                conn.abort("timeout")

    async def drain(self, timeout: float) -> None:
        """Wait for every request in flight; abort the ones still going after `timeout`."""
        self._maybe_drained()
        try:
            await asyncio.wait_for(self._drained.wait(), timeout)
        except TimeoutError:
            for conn in list(self.busy):
                conn.abort("timeout")
            await asyncio.sleep(0)

    def take(self) -> list[Sample]:
        out, self.done = self.done, []
        return out

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for conn in self.idle + list(self.busy):
            if conn.transport is not None:
                conn.transport.abort()
        self.idle.clear()
        self.busy.clear()
        await asyncio.sleep(0)


NOT_SENT = "not sent: too many requests in flight (the target is overloaded)"


async def open_loop(pool: Pool, rate: float, seconds: float, max_in_flight: int | None = None,
                    clock: Callable[[], float] = time.perf_counter) -> list[Sample]:
    """Send `rate` requests per second for `seconds`, then wait for them all; the samples.

    Requests due within half a millisecond go out together: the event loop's timers tick
    in whole milliseconds, and sleeping for less would only add lag. Past `max_in_flight`
    the target is taken as overloaded: the rest of the schedule is recorded as not sent
    (errors), so that a slow target costs seconds, not minutes, of draining.
    """
    n = max(1, round(rate * seconds))
    start = clock() + 0.002
    i = 0
    last_expire = start
    while i < n:
        now = clock()
        due = start + i / rate
        if due > now + 0.0005:
            await asyncio.sleep(due - now)
            continue
        if max_in_flight is not None and pool.in_flight > max_in_flight:
            pool.done += [Sample(due=start + j / rate, error=NOT_SENT) for j in range(i, n)]
            break
        pool.send(Sample(due=due))
        i += 1
        if i % 64 == 0:
            await asyncio.sleep(0)  # a client far behind still reads its responses
        if now - last_expire > 0.25:
            pool.expire(now, REQUEST_TIMEOUT_S)
            last_expire = now
    await pool.drain(REQUEST_TIMEOUT_S)
    return pool.take()


async def closed_loop(pool: Pool, concurrency: int, seconds: float,
                      clock: Callable[[], float] = time.perf_counter) -> tuple[list[Sample], float]:
    """`concurrency` clients, each sending its next request as soon as its previous one
    ends, for `seconds`: the target's throughput when it is the bottleneck. Returns the
    samples and the time from the first send to the last answer."""
    await pool.warm(concurrency)
    stop_at = clock() + seconds

    def refill() -> None:
        now = clock()
        if now < stop_at:
            pool.send(Sample(due=now))

    pool.refill = refill
    start = clock()
    try:
        for _ in range(concurrency):
            pool.send(Sample(due=start))
        await asyncio.sleep(max(0.0, stop_at - clock()))  # refill sends nothing after
        await pool.drain(REQUEST_TIMEOUT_S)
    finally:
        pool.refill = None
    samples = pool.take()
    return samples, max((s.done for s in samples), default=start) - start
