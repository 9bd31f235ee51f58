"""The ASGI endpoint of the generation routes: the request's two tasks and its client.

Each request runs as two tasks: the work (an ``Exchange``: its stages from validation to
settlement) and a watcher on the client's connection. When the client leaves, at
any stage, the watcher cancels the work; cancellation closes the upstream response, which
the bundled backend sees as a disconnect and aborts the request in the engine.

Slow clients. Every message to the client goes through ``bounded_send``: the server's
``send`` waits while the client's socket buffer is full (uvicorn's flow control), so what a
connection buffers is bounded by the socket buffers plus one batch of events, and a client
that takes nothing for ``timeouts.client_stall_s`` gets ``ClientStalled``: the exchange
ends as cancelled, the upstream response is closed (the engine aborts and frees its KV
blocks), and the reservation and slot are settled as for any other end.

Draining. Once SIGTERM set ``app.state.draining``, new requests get 503 with Retry-After
(``code: draining``) while those in flight finish (``sluice gateway``'s shutdown timeout).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from protocol.http import clean_request_id, parse_json_object
from protocol.large_bodies import parse_body

from .client_io import (
    ClientGone,
    ClientStalled,
    Reply,
    Scope,
    deadline_header,
    header,
    read_body,
    send_error,
)
from .contract import Kind
from .errors import GatewayError, InternalError, ServiceUnavailable
from .exchange import Exchange
from .observe import observe, outcome_of
from .service import Gateway
from .timing import RequestTimes
from .tracing import AUTH, NO_TRACE, request_trace

log = logging.getLogger("sluice.gateway.relay")

DRAIN_RETRY_AFTER_S = 1.0
LARGE_BODY_BYTES = 256 * 1024  # parsed in the parse pool's process: ~2 ms of parsing and up


def bounded_send(send: Any, stall_s: float) -> Any:
    """``send``, raising ``ClientStalled`` when the client takes nothing for ``stall_s``.

    A timer per message costs ~6 µs (``asyncio.timeout`` arms and cancels a loop timer), and
    a streamed request sends once per batch of events the upstream delivers: up to one per
    token. Under uvicorn, ``send`` can only wait in one place: its
    flow control, while the transport's writing is paused (the client's socket buffer is
    full). So when uvicorn's ``flow.write_paused`` is false the message goes out without a
    timer, since it cannot wait; the timer is armed only when it can. Under another server
    (no such flag), every message gets the timer.
    """
    flow = getattr(getattr(send, "__self__", None), "flow", None)
    stalled = f"the client read nothing for {stall_s} s"

    async def send_bounded(message: dict[str, Any]) -> None:
        try:
            async with asyncio.timeout(stall_s):
                await send(message)
        except TimeoutError:
            raise ClientStalled(stalled) from None

    if flow is None or not isinstance(getattr(flow, "write_paused", None), bool):
        return send_bounded

    async def send_unless_paused(message: dict[str, Any]) -> None:
        if not flow.write_paused:
            await send(message)  # uvicorn's send does not wait unless writing is paused
            return
        await send_bounded(message)

    # a marker on the function object: tests check which sender uvicorn's flow gave
    send_unless_paused.watches_flow = True  # type: ignore[attr-defined]  # a function attr
    return send_unless_paused


class ProxyEndpoint:
    """ASGI endpoint for ``POST /v1/chat/completions`` or ``/v1/completions``.

    The app's outermost layer routes these two straight here, past Starlette's middleware
    (see ``app.FastLane``), so this endpoint is its own last line of defence: an unexpected
    exception is logged and answered with a 500 in OpenAI's shape, never a stack trace.
    """

    def __init__(self, kind: Kind, route: str, app_state: Any) -> None:
        self.kind = kind
        self.route = route
        self.app_state = app_state  # Starlette's app.state: the lifespan puts the Gateway there

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        gw: Gateway = self.app_state.gateway
        times = RequestTimes(time.monotonic())
        request_id = clean_request_id(header(scope, b"x-request-id")) or uuid.uuid4().hex
        trace = request_trace(gw.tracer, self.kind, self.route, request_id,
                              header(scope, b"traceparent"), header(scope, b"tracestate")) \
            if gw.telemetry.tracing else NO_TRACE
        reply = Reply(bounded_send(send, gw.config.timeouts.client_stall_s), request_id,
                      self.route, gw.metrics, trace)
        exchange: Exchange | None = None
        body_bytes = 0
        try:
            exchange, body_bytes = await self._serve(gw, scope, receive, reply, times)
        except ClientStalled:
            pass  # stalled outside an exchange (an error reply it would not read)
        except Exception as exc:
            log.exception("unhandled error (request id %s)", request_id, exc_info=exc)
            if not reply.started:
                await send_error(reply, InternalError(
                    f"internal error ({type(exc).__name__}); request id {request_id}"), None)
        finally:
            ended = exchange.ended if exchange is not None else None
            outcome = outcome_of(reply, ended)
            observe(gw.metrics, reply, ended, times, outcome, self.kind)
            trace.finish(reply.status or 499, outcome.value)
        gw.trimmer.after(body_bytes)  # a large body's memory goes back once it is freed

    async def _serve(self, gw: Gateway, scope: Scope, receive: Any, reply: Reply,
                     times: RequestTimes) -> tuple[Exchange | None, int]:
        """The exchange that ran, if any, and how many bytes of body were read."""
        trace = reply.trace
        if self.app_state.draining:
            await send_error(reply, ServiceUnavailable(
                "the gateway is shutting down; retry on another replica",
                retry_after_s=DRAIN_RETRY_AFTER_S, code="draining"), None)
            return None, 0
        try:
            tenant = gw.registry.authenticate(header(scope, b"authorization"))
        except GatewayError as err:
            trace.event(AUTH, **{"error.type": err.code or "auth"})
            await send_error(reply, err, None)
            return None, 0
        trace.event(AUTH, **{"sluice.tenant.id": tenant.id})
        trace.set(tenant=tenant.id)
        reply.tenant = tenant.id
        raw = b""
        try:
            limit = gw.config.max_body_bytes
            if tenant.caps.max_body_bytes is not None:
                limit = min(limit, tenant.caps.max_body_bytes)
            raw = await read_body(scope, receive, limit)
            if len(raw) < LARGE_BODY_BYTES:
                body = parse_json_object(raw)
            else:  # tens of ms of parsing: in a worker process, tenants in turn
                body = await parse_body(gw.parse_pool, tenant.id, raw)
            deadline_ms = deadline_header(scope)
        except GatewayError as err:
            await send_error(reply, err, None)
            return None, len(raw)
        except ClientGone:
            return None, len(raw)
        body_bytes, raw = len(raw), b""  # parsed: the bytes can go now
        gw.metrics.inflight += 1
        exchange = Exchange(gw, self.kind, tenant, reply, times)
        work = asyncio.ensure_future(exchange.run(body, deadline_ms))
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client left first
                work.cancel()
            # the exchange answers its own errors (a bug included: a 500) and ends either way
            await asyncio.gather(work, return_exceptions=True)
        finally:
            watcher.cancel()
            if not work.done():  # we were cancelled ourselves (server shutdown)
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            gw.metrics.inflight -= 1
        return exchange, body_bytes


async def _wait_disconnect(receive: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
