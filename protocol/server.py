"""The HTTP/1.1 connection both Sluice servers run under uvicorn: slow senders are cut off,
open connections are capped, every answer of its own is in OpenAI's error shape.

``http_protocol(limits, counts)`` is a small subclass of uvicorn's httptools protocol, handed
to ``uvicorn.Config(http=...)``. Stock uvicorn waits forever for a request: a head or a body
trickled at one byte a second (slowloris), or a connection that never sends a byte, holds a
file descriptor indefinitely (its keep-alive timer runs only after a response). Here each
connection has one read timer, in three phases (``ConnectionLimits`` states the rules):

    HEAD  armed at the connection's start, or at the first byte after a finished request;
          the head must end within request_read_s. Else: a minimal ``HTTP/1.1 408`` (JSON
          body) and close, or just close if no request byte came at all (blank lines are no
          request: the parser skips them, and some clients send one after a body). The ASGI
          app never sees an incomplete head.
    BODY  from the head's end: t seconds in, at least (t - request_read_s) × min rate bytes
          must have arrived. The timer fires at the schedule's next due time and re-arms
          while the client keeps up; the server's own pauses (flow control, a 100-continue
          not yet sent) restart the schedule, so only the client's slowness counts. Else:
          the app sees ``http.disconnect`` and the client gets a JSON 408 if no answer has
          started (else the connection just closes). This also covers a body still trickling
          after the app answered without reading it.
    IDLE  between requests: uvicorn's keep-alive timer (``timeout_keep_alive``, 5 s) closes
          an idle connection.

A request on a kept-alive connection arms no timer of its own: the connection's timer
outlives requests and re-arms when it fires (at most once per request_read_s while the
connection is busy), so the cost per request is a few attribute writes; the base class's
methods are called directly, not through super(), on this per-request path.

Sizes: a head over ``MAX_HEAD_BYTES`` gets 431. So does a chunked body whose bytes after
its last payload byte (trailer lines, which uvicorn keeps in the request's headers, and
framing) pass ``MAX_TRAILER_BYTES``: a counter zeroed by each payload chunk, checked once a
read. A parser error gets a JSON 400 instead of uvicorn's text/plain one. Every answer the
protocol writes itself is ``protocol.http.error_response`` plus ``connection: close``, and
is written only where it cannot cross another answer on the wire (else the connection is
just closed); a request whose app runs sees ``http.disconnect``.

The cap counts the listener's open connections (uvicorn's ``server_state.connections``): a
connection accepted past ``max_connections`` gets 503 ``too_many_connections`` with
Retry-After once its head has arrived (uvicorn's ``limit_concurrency`` would answer a
plain-text 503 without Retry-After), never reaching the app. Each cut and refusal is
counted by ``Cut`` in the listener's ``ConnectionCounts``, which the server's /metrics shows.

uvicorn's protocol internals used here are private (``pipeline``, ``cycle``, ``flow``,
``headers``, ``scope``, ``send_400_response``…): pyproject pins the uvicorn versions tested,
and ``http_protocol`` checks them when a server builds its protocol (``check_uvicorn``),
failing at start rather than losing the protection in a loop callback.
"""

from __future__ import annotations

import asyncio
import http
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import uvicorn
from starlette.responses import Response
from uvicorn.config import Config
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from .errors import (
    ApiError,
    BadRequest,
    HeadTooLarge,
    RequestTimeout,
    ServiceUnavailable,
)
from .http import error_response
from .limits import MAX_HEAD_BYTES, MAX_TRAILER_BYTES, ConnectionCounts, ConnectionLimits, Cut

if TYPE_CHECKING:  # uvicorn's types, for mypy only: nothing at run time depends on them
    from uvicorn._types import (
        ASGI3Application,
        ASGIReceiveCallable,
        ASGISendCallable,
        Scope,
    )

log = logging.getLogger("sluice.http")

REFUSED_RETRY_AFTER_S = 1.0  # a connection slot frees as soon as any client finishes
_DRAIN_BYTES = 64 * 1024  # read this much of a refused request's body: closing with
# unread bytes resets the connection, and the client may lose the answer under the reset
_WARN_EVERY_S = 10.0
# Files a server needs besides its client connections: upstream and Redis connections,
# the engine's pipes, logs.
FILE_RESERVE = 1024

_IDLE, _HEAD, _BODY = 0, 1, 2


class _Listener:
    """What one listener's connections share: the limits, the counts, the refusal log's
    rate."""

    __slots__ = ("counts", "last_warned", "limits")

    def __init__(self, limits: ConnectionLimits, counts: ConnectionCounts) -> None:
        self.limits = limits
        self.counts = counts
        self.last_warned = float("-inf")

    def refusing(self) -> None:
        refused = self.counts.add(Cut.TOO_MANY_CONNECTIONS)
        now = time.monotonic()
        if now - self.last_warned >= _WARN_EVERY_S:
            self.last_warned = now
            log.warning("over %d open connections: refusing new ones with 503 (%d so far)",
                        self.limits.max_connections, refused)


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with read deadlines and a connection cap (module doc)."""

    listener: _Listener  # set on the class by http_protocol()

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        limits = self.listener.limits
        self._read_s = limits.request_read_s
        self._rate = float(limits.body_min_bytes_per_s)
        self._phase = _IDLE
        # Armed whenever a request is being read; it outlives the request it was armed for
        # (no cancel and re-arm per request on a kept-alive connection: firing, it re-arms
        # for whatever is being read then, or lapses if nothing is).
        self._timer: asyncio.TimerHandle | None = None
        self._head_due = 0.0
        self._head_bytes = 0
        # The scope of the last request read whole. The parser makes a new scope at a
        # request's first byte (on_message_begin, which skips blank lines): while scope is
        # still this one, no byte of a next request has come.
        self._done_scope: object = None
        self._body_start = 0.0
        self._body_bytes = 0
        self._unpaid = 0  # bytes read since the body's last payload byte (on_body zeroes)

    # ---- connection ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # as uvicorn's: the loop hands a Transport
        super().connection_made(transport)
        if len(self.connections) > self.listener.limits.max_connections:
            self.listener.refusing()
            self.app = _REFUSE  # answered once its head is in; never reaches the app
        self._begin_head()  # a connection that never sends a byte is cut too

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._phase == _BODY:
            self._unpaid += len(data)
            HttpToolsProtocol.data_received(self, data)
            # Trailer lines go to on_header, which keeps them all: bounded here, once a read
            # (so a read's worth past the limit may be kept before the cut).
            if self._unpaid > MAX_TRAILER_BYTES and self._phase == _BODY \
                    and not self.transport.is_closing():
                self._refuse(HeadTooLarge(
                    f"the request's trailers (what follows its last chunk of payload) "
                    f"exceed {MAX_TRAILER_BYTES} bytes"), Cut.TRAILERS_TOO_LARGE)
            return
        if self._phase == _IDLE:
            self._begin_head()
        self._head_bytes += len(data)
        HttpToolsProtocol.data_received(self, data)
        if self._phase == _HEAD and self._head_bytes > MAX_HEAD_BYTES \
                and not self.transport.is_closing():
            self._refuse(HeadTooLarge(f"the request head exceeds {MAX_HEAD_BYTES} bytes"),
                         Cut.HEAD_TOO_LARGE)

    def handle_websocket_upgrade(self) -> None:
        self._cancel_timer()  # the connection is no longer ours to time
        self._phase = _IDLE
        super().handle_websocket_upgrade()

    def send_400_response(self, msg: str) -> None:
        """The parser refused the bytes (uvicorn logs ``msg``): a JSON 400, not text."""
        self._refuse(BadRequest("the request is not valid HTTP/1.1",
                                code="invalid_http_request"), Cut.BAD_REQUEST)

    # ---- parser callbacks ---------------------------------------------------------------
    # (A request pipelined behind another in one read gets its head deadline from the next
    # read, if it needs one: on_message_begin is not overridden, one call less a request.)
    def on_headers_complete(self) -> None:
        if self._head_bytes > MAX_HEAD_BYTES and self._head_size() > MAX_HEAD_BYTES:
            self.listener.counts.add(Cut.HEAD_TOO_LARGE)
            self.app = _HEAD_TOO_LARGE  # the head came whole in one read: answer, then close
        self._phase = _BODY
        self._body_start = self.loop.time()
        self._body_bytes = 0
        self._unpaid = 0
        HttpToolsProtocol.on_headers_complete(self)

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        self._unpaid = 0
        HttpToolsProtocol.on_body(self, body)

    def on_message_complete(self) -> None:
        self._phase = _IDLE
        self._done_scope = self.scope
        HttpToolsProtocol.on_message_complete(self)

    def _head_size(self) -> int:
        return len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)

    # ---- the read timer -----------------------------------------------------------------
    def _begin_head(self) -> None:
        self._phase = _HEAD
        self._head_bytes = 0
        self._head_due = self.loop.time() + self._read_s
        if self._timer is None:
            self._timer = self.loop.call_at(self._head_due, self._on_timer)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        now = self.loop.time()
        if self._phase == _BODY:
            cycle = self.cycle
            if self.flow.read_paused or (cycle is not None and cycle.waiting_for_100_continue):
                # we hold the body back, not the client: its schedule starts again from now
                self._body_start = now - self._body_bytes / self._rate
            due = self._body_start + self._read_s + self._body_bytes / self._rate
            if due > now:
                self._timer = self.loop.call_at(due, self._on_timer)
                return
            self._refuse(RequestTimeout(
                f"the request body arrived slower than {self._rate:g} bytes/s (after a "
                f"{self._read_s:g} s grace): received {self._body_bytes} bytes"),
                Cut.BODY_TIMEOUT)
        elif self._phase == _HEAD:
            if self._busy():
                # An earlier answer is still going out on this connection (bytes after it:
                # a pipelined request, or the stray CRLF some clients send after a body):
                # the head's clock starts when the connection is ours to read again.
                self._head_due = now + self._read_s
            if self._head_due > now:  # armed for an earlier request, or busy
                self._timer = self.loop.call_at(self._head_due, self._on_timer)
                return
            if self.scope is self._done_scope:
                # No request byte (none at all, or blank lines): an idle connection, closed
                # silently as uvicorn's keep-alive timer does (a 408 could cross a request
                # on the wire).
                self.listener.counts.add(Cut.IDLE)
                self.transport.close()
                return
            self._refuse(RequestTimeout(
                f"the request head did not arrive within {self._read_s:g} s"),
                Cut.HEAD_TIMEOUT)
        # _IDLE: nothing is being read; the next request's first byte arms the timer

    def _busy(self) -> bool:
        return bool(self.pipeline) or (self.cycle is not None
                                       and not self.cycle.response_complete)

    def _refuse(self, err: ApiError, cut: Cut) -> None:
        """Count ``cut``, answer ``err`` where that answer cannot cross another on the wire,
        and close. The app reading this request's body sees ``http.disconnect`` (and its
        sends are dropped)."""
        self.listener.counts.add(cut)
        cycle = self.cycle
        if self._phase == _BODY and cycle is not None:  # this request's own cycle
            answerable = not cycle.response_started and not self.pipeline
            cycle.disconnected = True
            cycle.message_event.set()
        else:  # between requests: the last one's answer may still be going out
            answerable = not self._busy()
        self._phase = _IDLE
        if answerable:
            self.transport.write(_raw_answer(err, self.server_state.default_headers))
        self.transport.close()


def _closing_answer(err: ApiError) -> Response:
    """``err`` as the apps answer it (``protocol.http.error_response``), closing."""
    response = error_response(err)
    response.raw_headers.append((b"connection", b"close"))
    return response


def _raw_answer(err: ApiError, default_headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """``_closing_answer(err)`` as bytes on the wire, for a connection no ASGI cycle owns."""
    response = _closing_answer(err)
    phrase = http.HTTPStatus(err.status).phrase
    parts = [f"HTTP/1.1 {err.status} {phrase}\r\n".encode()]
    for name, value in [*default_headers, *response.raw_headers]:
        parts += [name, b": ", value, b"\r\n"]
    parts += [b"\r\n", bytes(response.body)]
    return b"".join(parts)


def _answering(err: ApiError) -> ASGI3Application:
    """An ASGI app that answers ``_closing_answer(err)``, for a request that must not reach
    the real app (over the connection cap, a head too large), in its turn on the wire."""
    response = _closing_answer(err)

    async def app(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        drained = 0
        while drained < _DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return
            drained += len(message["body"])
            if not message.get("more_body", False):
                break
        await response(cast(Any, scope), cast(Any, receive), cast(Any, send))  # Starlette's and uvicorn's ASGI types describe the same messages

    return app


_REFUSE = _answering(ServiceUnavailable(
    "too many open connections to this server; retry shortly", code="too_many_connections",
    retry_after_s=REFUSED_RETRY_AFTER_S))
_HEAD_TOO_LARGE = _answering(HeadTooLarge(f"the request head exceeds {MAX_HEAD_BYTES} bytes"))


def fit_file_limit(limits: ConnectionLimits, reserve: int = FILE_RESERVE) -> int:
    """Raise this process's soft open-file limit (up to the hard one) to hold the connection
    cap plus ``reserve``, as Go's runtime does at start; warn if it cannot. Otherwise the
    cap is never reached: accept() fails with EMFILE first and nobody gets a clean 503.
    Returns the soft limit now in force. For a server's entry point, not a library."""
    import resource

    wanted = limits.max_connections + reserve
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit to %d: %s", target, exc)
        if soft < wanted:
            log.warning("open-file limit %d is under max_connections %d + %d in reserve: "
                        "raise it (ulimit -n) or lower max_connections",
                        soft, limits.max_connections, reserve)
    return int(soft)


# ---- the uvicorn this module leans on ----------------------------------------------------
TESTED_UVICORN = ">=0.29,<0.55"  # pyproject.toml allows exactly these (a test holds them equal)

# What GuardedHttpProtocol reads, writes, overrides or calls of uvicorn's private protocol.
_METHODS = ("connection_made", "connection_lost", "data_received", "handle_websocket_upgrade",
            "send_400_response", "on_message_begin", "on_headers_complete", "on_body",
            "on_message_complete")
_PROTOCOL_FIELDS = ("loop", "transport", "flow", "connections", "server_state", "app",
                    "pipeline", "cycle", "scope", "headers", "url")
_CYCLE_FIELDS = ("disconnected", "message_event", "response_started", "response_complete",
                 "waiting_for_100_continue")


async def _no_app(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
    """The app of the protocol that ``check_uvicorn`` builds and never runs."""


def check_uvicorn() -> None:
    """Check that uvicorn's httptools protocol still has what ``GuardedHttpProtocol`` uses
    (private to uvicorn): raises RuntimeError naming what is missing, so that a server
    refuses to start instead of losing its read deadlines in a loop callback."""
    missing = [f"HttpToolsProtocol.{m}()" for m in _METHODS
               if not callable(getattr(HttpToolsProtocol, m, None))]
    if "app" not in HttpToolsProtocol.on_headers_complete.__code__.co_names:
        missing.append("HttpToolsProtocol.on_headers_complete() starting self.app")
    try:
        config = Config(_no_app, lifespan="off", ws="none", proxy_headers=False,
                        log_config=None)
        probe = HttpToolsProtocol(config, ServerState(), {},
                                  _loop=cast(asyncio.AbstractEventLoop, object()))
        probe.on_message_begin()  # what the parser calls at a request's first byte
        missing += [f"HttpToolsProtocol.{f}" for f in _PROTOCOL_FIELDS
                    if not hasattr(probe, f)]
        if not hasattr(probe.server_state, "default_headers"):
            missing.append("ServerState.default_headers")
        if probe.scope.get("headers") is not probe.headers:
            missing.append("on_message_begin() making a new scope holding self.headers")
        flow = FlowControl(cast(asyncio.Transport, None))
        if not hasattr(flow, "read_paused"):
            missing.append("FlowControl.read_paused")
        cycle = RequestResponseCycle(
            scope=probe.scope, transport=cast(asyncio.Transport, None), flow=flow,
            logger=log, access_logger=log, access_log=False, default_headers=[],
            message_event=asyncio.Event(), expect_100_continue=False, keep_alive=True,
            on_response=lambda: None)
        missing += [f"RequestResponseCycle.{f}" for f in _CYCLE_FIELDS
                    if not hasattr(cycle, f)]
    except Exception as exc:  # noqa: BLE001  # any failure here is the answer: say which
        missing.append(f"building its protocol ({type(exc).__name__}: {exc})")
    if missing:
        raise RuntimeError(
            f"protocol.server cannot guard uvicorn {uvicorn.__version__}'s HTTP protocol "
            f"(tested: uvicorn{TESTED_UVICORN}): missing {', '.join(missing)}. Install the "
            f"uvicorn version pyproject.toml allows, or adapt protocol/server.py.")


def http_protocol(limits: ConnectionLimits,
                  counts: ConnectionCounts | None = None) -> type[GuardedHttpProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)``: one per server (its cap's log),
    counting its cuts and refusals in ``counts``. Raises RuntimeError (``check_uvicorn``)
    on a uvicorn whose protocol it cannot guard."""
    check_uvicorn()

    class Protocol(GuardedHttpProtocol):
        listener = _Listener(limits, counts or ConnectionCounts())

    return Protocol
