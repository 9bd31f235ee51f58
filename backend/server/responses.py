"""ASGI responses that run a generation: streamed (SSE) or whole (JSON).

Both race the generation against the client's ``http.disconnect`` in two tasks, as
Starlette's StreamingResponse does: a disconnect cancels the generation task, which leaves
the engine's stream and so aborts the request in the engine (its KV blocks are freed before
the next step). A request still waiting in the engine queue is aborted the same way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from backend.engine.errors import EngineError
from backend.engine.outputs import TokenLogprob
from protocol.errors import ApiError, InternalError, ServiceUnavailable
from protocol.sse import dumps, error_event

from .errors import from_engine_error
from .service import ModelService, Prepared
from .sse import Choice, ChunkEncoder, whole_response
from .tool_calls import ToolCallEncoder
from .tracing import RequestRecord

log = logging.getLogger("sluice.backend")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
JSON_HEADERS = [(b"content-type", b"application/json")]


class ClientGone(Exception):
    """The client disconnected before the answer was complete."""


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(work: Awaitable[None], receive: Receive) -> None:
    """Run ``work`` until done, or cancel it when the client disconnects (→ ClientGone)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when our own task is cancelled (shutdown): the engine request aborts
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    task.result()  # re-raise the generation's own error


async def send_json(send: Send, status: int, body: bytes,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": JSON_HEADERS + (headers or [])})
    await send({"type": "http.response.body", "body": body})


class GenerationResponse:
    """Runs ``prepared`` on the engine when the server calls it as an ASGI app."""

    def __init__(self, service: ModelService, prepared: Prepared,
                 record: RequestRecord) -> None:
        self.service = service
        self.p = prepared
        self.rec = record  # status, error and fate, for the request's metrics and trace
        self._started = False  # response headers sent

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Per-token body chunks skip every send wrapper (ours and Starlette's act on
        # http.response.start only: headers, status): one coroutine call less per layer.
        raw_send = scope.get("state", {}).get("raw_send", send)
        run = self._stream(send, raw_send) if self.p.stream else self._whole(send)
        try:
            await race_disconnect(run, receive)
        except (ClientGone, OSError):  # OSError: the transport failed under a send
            self.service.metrics.disconnects.inc()
            self.rec.gone = True
        except asyncio.CancelledError:
            # The server's grace period ran out (SIGTERM): the engine request is aborted
            # by now; tell the client why instead of cutting the stream silently.
            # Ending normally (not re-raising) spares the log a traceback per request.
            self.rec.shutdown = True
            await self._send_aborted(send)
        finally:
            self.service.end(self.rec)

    async def _send_aborted(self, send: Send) -> None:
        err = ServiceUnavailable("the request was aborted: the server is shutting down",
                                 code="aborted")
        try:
            if not self._started:
                self.rec.status = err.status
                await send_json(send, err.status, err.json_bytes())
            else:
                await send({"type": "http.response.body", "body": error_event(err)})
        except Exception as exc:  # noqa: BLE001 - the connection may be gone already
            log.debug("could not tell the client about the abort: %r", exc)

    def _logprobs(self, entries: list[tuple[int, TokenLogprob]]) -> dict[str, Any] | None:
        """The whole response's logprobs object, when the request asked for one."""
        if self.p.params.logprobs is None:
            return None
        fmt = self.service.logprob_format
        return fmt.chat(entries) if self.p.kind == "chat" else fmt.completion(entries, 0)[0]

    async def _whole(self, send: Send) -> None:
        choices = [Choice() for _ in range(self.p.params.n)]
        try:
            stream = await self.service.open(self.p, self.rec)
            async with stream:  # closing it aborts the request unless it finished
                async for delta in stream:
                    choices[delta.index].add(delta)
                    if not delta.finished:
                        continue
                    if delta.finish_reason == "abort":
                        raise ServiceUnavailable(
                            "the request was aborted: the server is shutting down")
                    lps = None if self.p.params.logprobs is None \
                        else [self._logprobs(c.entries) for c in choices]
                    body = whole_response(self.p, choices, delta, lps)
                    self._started = True
                    self.rec.status = 200
                    self.service.end(self.rec)
                    await send_json(send, 200, dumps(body).encode())
                    return
        except (EngineError, ApiError) as exc:
            failure = exc if isinstance(exc, ApiError) else from_engine_error(exc)
            self.rec.error = failure
            self.rec.status = failure.status
            await send_json(send, failure.status, failure.json_bytes())
            return
        bug = self.rec.error = InternalError("the engine ended the stream without a final output")
        self.rec.status = bug.status
        await send_json(send, bug.status, bug.json_bytes())

    async def _stream(self, send: Send, raw_send: Send) -> None:
        wants_logprobs = self.p.params.logprobs is not None
        base = ChunkEncoder(self.p, self.service.logprob_format if wants_logprobs else None)
        enc: ChunkEncoder | ToolCallEncoder = base
        if self.p.kind == "chat" and self.p.structured.calls_tools:
            enc = ToolCallEncoder(base)  # text read as content and tool_calls deltas
        # per choice, the logprobs of tokens not yet sent
        pending: dict[int, list[tuple[int, TokenLogprob]]] = {}
        self._started = True
        self.rec.status = 200
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        first = enc.first()
        if first is not None:
            await raw_send({"type": "http.response.body", "body": first, "more_body": True})
        chunk = enc.text  # per token: one escape, one join, one send (no other layers)
        try:
            stream = await self.service.open(self.p, self.rec)
            async with stream:  # closing it aborts the request unless it finished
                async for delta in stream:
                    if delta.logprobs is not None:
                        pending.setdefault(delta.index, []).extend(
                            zip(delta.token_ids, delta.logprobs))
                    if delta.finished:
                        if delta.finish_reason == "abort":
                            err = self.rec.error = ServiceUnavailable(
                                "the request was aborted: the server is shutting down",
                                code="aborted")
                            body = error_event(err)
                        else:
                            body = enc.final(delta, pending.pop(delta.index, []))
                            self.service.end(self.rec)
                        await raw_send({"type": "http.response.body", "body": body})
                        return
                    if delta.finish_reason is not None:  # one choice of several ends
                        await raw_send({"type": "http.response.body", "more_body": True,
                                        "body": enc.end(delta, pending.pop(delta.index, []))})
                    elif delta.text:  # an empty delta holds back a partial character or stop
                        if pending and delta.index in pending:  # they go with the next text
                            body = enc.with_logprobs(delta.text, delta,
                                                     pending.pop(delta.index))
                        else:
                            body = chunk(delta.text, delta)
                        await raw_send({"type": "http.response.body", "body": body,
                                        "more_body": True})
        except (EngineError, ApiError) as exc:
            failure = self.rec.error = exc if isinstance(exc, ApiError) \
                else from_engine_error(exc)
            body = error_event(failure)
            await send({"type": "http.response.body", "body": body})
            return
        bug = self.rec.error = InternalError("the engine ended the stream without a final output")
        await send({"type": "http.response.body", "body": error_event(bug)})
