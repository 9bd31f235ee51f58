"""A lean HTTP/1.1 client for the relay's hot path: asyncio protocol + httptools.

The relay spends most of its time moving small SSE events; a general client (httpx, with
httpcore, anyio and h11 under it) costs several times more CPU per event than parsing the
bytes with httptools (the parser uvicorn uses) in a plain ``asyncio.Protocol``. This client
does one thing: POST a body and hand back the status, the headers and the body chunks as
they arrive, over pooled keep-alive connections (http, or https with the system's CA
store) with TCP_NODELAY.

Invariants:
* a connection carries one request at a time; it goes back to the pool only when its
  response was read to the end and the server keeps it alive, and is closed otherwise (so
  closing a response early closes the connection, which is how an upstream learns that the
  client left);
* body chunks are buffered up to ``HIGH_WATER`` bytes, then the socket stops being read
  until the consumer catches up (bounded buffering, backpressure to the upstream);
* a request on a reused connection that fails before any byte of the answer is retried once
  on a new connection (the server closed the idle connection as we wrote to it).

Errors (all ``UpstreamHTTPError``): ``ConnectFailed`` (refused, unreachable, connect
timeout, pool full for too long), ``ReadTimeout``: ``FirstByteTimeout`` (no answer within
``first_byte_s``) or ``IdleTimeout`` (a gap between chunks longer than ``read_s``),
``ProtocolFailed`` (a broken answer, or the connection lost mid-answer).
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httptools

HIGH_WATER = 256 * 1024


class UpstreamHTTPError(Exception):
    pass


class ConnectFailed(UpstreamHTTPError):
    pass


class ReadTimeout(UpstreamHTTPError):
    pass


class FirstByteTimeout(ReadTimeout):
    """No answer (status line and headers) within ``first_byte_s`` of sending."""


class IdleTimeout(ReadTimeout):
    """A gap between two chunks of an answer longer than ``read_s``."""


class ProtocolFailed(UpstreamHTTPError):
    pass


class _Connection(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.lost: Exception | None = None
        self._parser: Any = None
        self._waiter: asyncio.Future[None] | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.complete = False
        self.received_any = False
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False

    # ---- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            self.lost = ProtocolFailed(f"the upstream closed the connection"
                                       f"{': ' + str(exc) if exc else ''}")
        self._wake()

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        if self._parser is None:  # bytes while idle: the server is confused; drop it
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.lost = ProtocolFailed(f"the upstream sent a malformed answer: {exc}")
            self.close()
        except httptools.HttpParserUpgrade:
            self.lost = ProtocolFailed("the upstream tried to upgrade the connection")
            self.close()
        self._wake()

    # ---- httptools callbacks --------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.complete = True

    # ---- used by the pool and the response ---------------------------------------------------
    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self, timeout: float, error: type[ReadTimeout] = IdleTimeout) -> None:
        """Until something arrives (or the connection is lost), at most ``timeout`` s."""
        waiter = self.loop.create_future()
        self._waiter = waiter
        timer = self.loop.call_later(timeout, _expire, waiter, error)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def start(self, request: bytes) -> None:
        self._reset()
        self._parser = httptools.HttpResponseParser(self)
        if self.closed or self.transport is None:
            self.lost = ProtocolFailed("the upstream closed the connection")
            return
        self.transport.write(request)

    def take(self) -> bytes:
        data = b"".join(self.chunks) if len(self.chunks) > 1 else self.chunks[0]
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return data

    @property
    def reusable(self) -> bool:
        return (self.complete and not self.closed and self._parser is not None
                and self._parser.should_keep_alive())

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _expire(waiter: asyncio.Future[None], error: type[ReadTimeout]) -> None:
    if not waiter.done():
        waiter.set_exception(error("the upstream sent nothing in time"))


class Response:
    """An upstream answer; read ``body_chunks()`` (or ``read()``), then ``close()``."""

    def __init__(self, pool: Pool, conn: _Connection) -> None:
        self._pool = pool
        self._conn = conn
        self.status = conn.status
        self._headers = conn.headers
        self._released = False

    def header(self, name: str) -> str | None:
        key = name.encode()
        for k, v in self._headers:
            if k == key:
                return v.decode("latin-1")
        return None

    async def body_chunks(self) -> AsyncIterator[bytes]:
        conn = self._conn
        read_s = self._pool.read_s
        while True:
            if conn.chunks:
                yield conn.take()
                continue
            if conn.complete:
                return
            if conn.lost is not None:
                raise conn.lost
            await conn.wait(read_s)

    async def read(self, limit: int) -> bytes:
        parts: list[bytes] = []
        size = 0
        async for chunk in self.body_chunks():
            size += len(chunk)
            if size > limit:
                raise ProtocolFailed(f"the upstream's answer is over {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        """Back to the pool if read to the end and kept alive; closed otherwise."""
        if self._released:
            return
        self._released = True
        self._pool._release(self._conn)


class Pool:
    """Keep-alive connections to one upstream (``http://host:port`` only)."""

    def __init__(self, base_url: str, *, max_connections: int, connect_s: float,
                 read_s: float, headers: dict[str, str] | None = None,
                 first_byte_s: float | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = parts.hostname
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.port = parts.port or (443 if self.ssl else 80)
        self.prefix = parts.path.rstrip("/")
        self.connect_s = connect_s
        self.read_s = read_s  # the longest gap between chunks of an answer
        self.first_byte_s = first_byte_s or read_s  # sending -> the answer's headers
        host_header = parts.netloc.encode()
        extra = b"".join(k.encode() + b": " + v.encode() + b"\r\n"
                         for k, v in (headers or {}).items())
        self._fixed_headers = b"host: " + host_header + b"\r\n" + extra
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(max_connections)
        self.active = 0  # connections lent to requests right now

    @property
    def idle_connections(self) -> int:
        return len(self._idle)

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(loop), self.host, self.port,
                                       ssl=self.ssl),
                self.connect_s)
        except (OSError, TimeoutError) as exc:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: "
                                f"{exc or type(exc).__name__}") from exc
        return conn

    def _take_idle(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        return None

    async def post(self, path: str, body: bytes,
                   headers: list[tuple[bytes, bytes]]) -> Response:
        """Send a POST and wait for the answer's status and headers."""
        try:
            await asyncio.wait_for(self._slots.acquire(), self.connect_s)
        except TimeoutError:
            raise ConnectFailed("every connection to the upstream is busy") from None
        self.active += 1
        request = (b"POST " + (self.prefix + path).encode() + b" HTTP/1.1\r\n"
                   + self._fixed_headers
                   + b"".join(k + b": " + v + b"\r\n" for k, v in headers)
                   + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        try:
            conn = self._take_idle()
            if conn is not None:
                try:
                    await self._exchange(conn, request)
                    return Response(self, conn)
                except ProtocolFailed:
                    if conn.received_any:
                        raise
                    conn.close()  # a stale keep-alive connection: once more, on a new one
            conn = await self._connect()
            try:
                await self._exchange(conn, request)
            except BaseException:
                conn.close()
                raise
            return Response(self, conn)
        except BaseException:
            self.active -= 1
            self._slots.release()
            raise

    async def _exchange(self, conn: _Connection, request: bytes) -> None:
        conn.start(request)
        try:
            while not conn.headers_done:
                if conn.lost is not None:
                    raise conn.lost
                await conn.wait(self.first_byte_s, FirstByteTimeout)
        except BaseException:
            conn.close()
            raise

    def _release(self, conn: _Connection) -> None:
        self.active -= 1
        self._slots.release()
        if conn.reusable:
            conn._parser = None
            self._idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
