"""An instant OpenAI-compatible upstream, for measuring what a gateway adds.

It shares the cores with the gateway and the load client, so every request must cost as
little CPU as possible: a raw asyncio `Protocol` parses HTTP/1.1 with httptools (keep-alive,
pipelined requests answered in order), and the SSE events are assembled from byte
templates instead of one `json.dumps` per chunk. Each event goes out in its own
`transport.write` (its own HTTP chunk), as a real token stream would.

Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (streamed or not),
`GET /v1/models`, `GET /health`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Self, cast

import httptools

# Contents of the content chunks, cycled; JSON-encoded once.
_WORDS = tuple(json.dumps(w).encode() for w in (
    "Lorem", " ipsum", " dolor", " sit", " amet", ",", " consectetur", " adipiscing",
    " elit", ". "))
MAX_BODY_BYTES = 16 * 1024 * 1024
_ROUTES = MappingProxyType({b"/v1/chat/completions": b"POST", b"/v1/completions": b"POST",
                           b"/v1/models": b"GET", b"/health": b"GET"})


@dataclass(slots=True, frozen=True)
class FakeSettings:
    """What every completion looks like: `chunks` content chunks, `delay_ms` apart."""

    chunks: int = 20
    delay_ms: float = 0.0
    model: str = "fake"

    def __post_init__(self) -> None:
        if self.chunks < 1:
            raise ValueError("chunks must be >= 1")
        if self.delay_ms < 0:
            raise ValueError("delay_ms must be >= 0")


@dataclass(slots=True)
class _Request:
    method: bytes
    path: bytes
    body: bytes
    keep_alive: bool


@dataclass(slots=True)
class _Reply:
    """A complete response (`frames` of one item), or a stream of chunked-encoding frames."""

    frames: list[bytes]
    streamed: bool = False
    close: bool = False


class _BodyTooLarge(Exception):
    pass


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None,
                 code: str = "invalid_request") -> None:
        super().__init__(message)
        self.param, self.code = param, code


# --- responses --------------------------------------------------------------------------

_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed",
            413: b"Payload Too Large"}


def _full(status: int, payload: bytes, *, close: bool = False) -> _Reply:
    head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n"
            % (status, _REASONS[status], len(payload), b"connection: close\r\n" if close else b""))
    return _Reply([head + payload], close=close)


def _error(status: int, message: str, *, kind: str = "invalid_request_error",
           code: str = "invalid_request", param: str | None = None,
           close: bool = False) -> _Reply:
    body = {"error": {"message": message, "type": kind, "code": code, "param": param}}
    return _full(status, json.dumps(body).encode(), close=close)


def _chunk(event: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(event), event)


def _prompt_tokens(chat: bool, body: dict[str, Any]) -> int:
    """Deterministic stand-in for a tokenizer: UTF-8 bytes of the prompt text // 4 + 1."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise _BadRequest("'messages' must be a list", "messages")
        size = 0
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                size += len(content.encode())
            elif isinstance(content, list):
                size += sum(len(str(part.get("text", "")).encode())
                            for part in content if isinstance(part, dict))
        return size // 4 + 1
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt.encode()) // 4 + 1
    if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt):
        return len(prompt)
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return len("".join(prompt).encode()) // 4 + 1
    raise _BadRequest("'prompt' must be a string, a list of strings or a list of token ids",
                      "prompt")


def _completion(settings: FakeSettings, chat: bool, raw: bytes, serial: int) -> _Reply:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _BadRequest(f"the body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise _BadRequest("the body must be a JSON object", code="invalid_json")
    model = body.get("model", settings.model)
    if not isinstance(model, str):
        raise _BadRequest("'model' must be a string", "model")
    prompt_tokens = _prompt_tokens(chat, body)
    n = settings.chunks
    usage = (b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}'
             % (prompt_tokens, n, prompt_tokens + n))
    streamed = body.get("stream") is True
    kind = b"text_completion"
    if chat:
        kind = b"chat.completion.chunk" if streamed else b"chat.completion"
    common = (b'"id":"%s-fake-%d","object":"%s","created":%d,"model":%s,'
              b'"system_fingerprint":"fp_fake"'
              % (b"chatcmpl" if chat else b"cmpl", serial, kind, int(time.time()),
                 json.dumps(model).encode()))
    if not streamed:
        text = json.dumps("".join(json.loads(_WORDS[i % len(_WORDS)]) for i in range(n)))
        choice = (b'"message":{"role":"assistant","content":%s}' if chat else b'"text":%s'
                  ) % text.encode()
        payload = (b'{%s,"choices":[{"index":0,%s,"logprobs":null,"finish_reason":"stop"}],'
                   b'"usage":%s}' % (common, choice, usage))
        return _full(200, payload)
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    tail = b',"usage":null}\n\n' if include_usage else b"}\n\n"
    head = b"data: {" + common + b',"choices":[{"index":0,'
    frames = []
    for i in range(n):
        word = _WORDS[i % len(_WORDS)]
        if chat:
            delta = b'"delta":{"role":"assistant","content":%s}' if i == 0 else \
                b'"delta":{"content":%s}'
        else:
            delta = b'"text":%s'
        finish = b'"stop"' if i == n - 1 else b"null"
        frames.append(_chunk(head + delta % word + b',"logprobs":null,"finish_reason":'
                             + finish + b"}]" + tail))
    frames[0] = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                 b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n" + frames[0])
    if include_usage:
        frames.append(_chunk(b'data: {%s,"choices":[],"usage":%s}\n\n' % (common, usage)))
    # The terminating zero-length chunk rides with [DONE]: the stream ends with that event.
    frames.append(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    return _Reply(frames, streamed=True)


def _models(settings: FakeSettings) -> _Reply:
    body = {"object": "list", "data": [{"id": settings.model, "object": "model",
                                        "created": 0, "owned_by": "fake-upstream"}]}
    return _full(200, json.dumps(body).encode())


def build_reply(settings: FakeSettings, method: bytes, path: bytes, body: bytes,
                serial: int) -> _Reply:
    """The whole answer to one request; never raises."""
    path = path.split(b"?", 1)[0].rstrip(b"/") or b"/"
    allowed = _ROUTES.get(path)
    if allowed is None:
        return _error(404, f"no route {path.decode(errors='replace')}", code="not_found")
    if method != allowed:
        return _error(405, f"{path.decode()} takes {allowed.decode()}",
                      code="method_not_allowed")
    if path == b"/health":
        return _full(200, b'{"status":"ok"}')
    if path == b"/v1/models":
        return _models(settings)
    try:
        return _completion(settings, path == b"/v1/chat/completions", body, serial)
    except _BadRequest as exc:
        return _error(400, str(exc), code=exc.code, param=exc.param)


# --- HTTP/1.1 server ---------------------------------------------------------------------

class _Connection(asyncio.Protocol):
    """One client connection; requests are answered strictly in arrival order."""

    def __init__(self, server: FakeUpstream) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.queue: deque[_Request] = deque()
        self.url = b""
        self.body: list[bytes] = []
        self.body_size = 0
        self.stream: Iterator[bytes] | None = None  # frames still to send, delayed
        self.stream_close = False
        self.timer: asyncio.TimerHandle | None = None
        self.paused = False

    # asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        # A client that leaves mid-stream is normal: drop what is left, log nothing.
        self.server.connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
        self.stream, self.transport = None, None
        self.queue.clear()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(_error(400, "upgrades are not supported", close=True))
        except httptools.HttpParserError as exc:
            # httptools wraps a callback's exception; on_body's size check is one of them.
            if isinstance(exc.__context__, _BodyTooLarge):
                self._fail(_error(413, "request body too large", close=True))
            else:
                self._fail(_error(400, f"malformed HTTP request: {exc}", close=True))

    def pause_writing(self) -> None:
        # The client reads slower than we answer: stop reading its next requests too.
        self.paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        if self.transport is not None:
            self.transport.resume_reading()
        if self.stream is not None and self.timer is None:
            self._next_frame()

    # httptools callbacks
    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body_size += len(body)
        if self.body_size > MAX_BODY_BYTES:
            raise _BodyTooLarge
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return  # pipelined after a request that closes the connection
        self.queue.append(_Request(self.parser.get_method(), self.url, b"".join(self.body),
                                   self.parser.should_keep_alive()))
        self.url, self.body, self.body_size = b"", [], 0
        self._pump()

    # answering
    def _fail(self, reply: _Reply) -> None:
        """A protocol error: answer it after what is already queued, then close."""
        self.queue.clear()
        if self.stream is None and self.transport is not None:
            self.transport.write(reply.frames[0])
            self.transport.close()
        else:
            self.stream_close = True

    def _pump(self) -> None:
        while self.queue and self.stream is None and self.transport is not None \
                and not self.transport.is_closing():
            request = self.queue.popleft()
            reply = build_reply(self.server.settings, request.method, request.path,
                                request.body, next(self.server.serials))
            close = reply.close or not request.keep_alive
            if reply.streamed and self.server.settings.delay_ms > 0:
                self.stream, self.stream_close = iter(reply.frames), close
                self._next_frame()
                return
            for frame in reply.frames:
                self.transport.write(frame)
            if close:
                self.transport.close()
                self.queue.clear()

    def _next_frame(self) -> None:
        self.timer = None
        if self.stream is None or self.transport is None or self.paused:
            return  # resume_writing() picks the stream up again
        frame = next(self.stream, None)
        if frame is None:
            self.stream = None
            if self.stream_close:
                self.transport.close()
            else:
                self._pump()
            return
        self.transport.write(frame)
        self.timer = self.loop.call_later(self.server.settings.delay_ms / 1000,
                                          self._next_frame)


@dataclass(slots=True)
class FakeUpstream:
    """A listening fake upstream; `await start()`, then `port`, then `await close()`."""

    host: str = "127.0.0.1"
    requested_port: int = 0
    settings: FakeSettings = field(default_factory=FakeSettings)
    connections: set[_Connection] = field(default_factory=set)
    serials: Iterator[int] = field(default_factory=itertools.count)
    _server: asyncio.Server | None = None

    async def start(self) -> Self:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), self.host,
                                                self.requested_port, reuse_address=True,
                                                backlog=4096)
        return self

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the fake upstream is not started")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.abort()
        await self._server.wait_closed()
        self._server = None

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def start_fake_upstream(host: str = "127.0.0.1", port: int = 0, chunks: int = 20,
                              delay_ms: float = 0.0, model: str = "fake") -> FakeUpstream:
    """Start listening in the running loop (port 0: any free port) and return the server."""
    settings = FakeSettings(chunks=chunks, delay_ms=delay_ms, model=model)
    return await FakeUpstream(host, port, settings).start()
