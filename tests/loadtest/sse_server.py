"""A small real HTTP server for the load client's tests, on its own thread and event loop.

Each request goes to ``behave(idx, body)`` (idx: the load client's ``x-loadtest-idx``, -1
for its start-up probes; else the server's count from 0), which says what to do:
answer with a status and headers, stream ``chunks`` SSE chunks with running usage, ``hang``
(read the request and never answer, as a server that stopped answering) or ``drop`` (close
the connection, as a server that died). The
server counts requests and the requests in flight (the most at once too), and stamps when
each arrived on ``time.perf_counter()`` (CLOCK_MONOTONIC on Linux, the client's clock).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Reply:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    chunks: int = 3  # content chunks of one token each (200 only)
    gap_s: float = 0.0  # pause before each chunk
    hang: bool = False  # never answer
    drop: bool = False  # close the connection without answering
    hold: threading.Event | None = None  # wait for this before answering


Behave = Callable[[int, dict[str, Any]], Reply]


def _chunk(payload: dict[str, Any]) -> bytes:
    return _chunk_raw(b"data: " + json.dumps(payload).encode() + b"\n\n")


class SSEServer:
    def __init__(self, behave: Behave) -> None:
        self.behave = behave
        self.requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.arrived: list[float] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> SSEServer:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop)
        self._server = fut.result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        async def close() -> None:
            assert self._server is not None
            self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client left, or stop() cancelled it
        finally:
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        method, path = lines[0].split(" ")[:2]
        headers = {k.strip().lower(): v.strip() for k, v in
                   (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        if method == "GET" and path.startswith("/v1/models"):
            data = json.dumps({"object": "list", "data": [{"id": "scripted"}]}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(data), data))
            await writer.drain()
            return True
        if method != "POST" or not path.endswith("completions"):  # e.g. the /metrics scrape
            writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
            return True
        n = self.requests
        self.requests += 1
        self.arrived.append(time.perf_counter())
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            idx = int(headers.get("x-loadtest-idx", n))
            reply = self.behave(idx, json.loads(body or b"{}"))
            if reply.hold is not None:
                while not reply.hold.is_set():
                    await asyncio.sleep(0.005)
            if reply.hang:
                await asyncio.sleep(3600)
            if reply.drop:
                return False
            if reply.status != 200:
                data = json.dumps({"error": {"message": "scripted refusal"}}).encode()
                extra = "".join(f"{k}: {v}\r\n" for k, v in reply.headers.items()).encode()
                writer.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\n%s"
                             b"content-length: %d\r\n\r\n%s"
                             % (reply.status, extra, len(data), data))
                await writer.drain()
                return True
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            for k in range(reply.chunks):
                if reply.gap_s:
                    await asyncio.sleep(reply.gap_s)
                writer.write(_chunk({"choices": [{"index": 0, "delta": {"content": " w"}}],
                                     "usage": {"prompt_tokens": 10, "completion_tokens": k + 1,
                                               "total_tokens": 11 + k}}))
                await writer.drain()
            writer.write(_chunk({"choices": [], "usage": {
                "prompt_tokens": 10, "completion_tokens": reply.chunks,
                "total_tokens": 10 + reply.chunks}}))
            writer.write(_chunk_raw(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
            return True
        finally:
            self.in_flight -= 1


def _chunk_raw(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)
