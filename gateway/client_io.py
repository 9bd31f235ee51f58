"""The client's side of a generation request: reading the request, writing the answer.

``Reply`` is what the relay writes through: ``start`` adds ``x-request-id`` and counts the
status, body messages go to the server's ``send`` through one wrapper, the stall timeout
(``endpoint.bounded_send``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from protocol.errors import detached
from protocol.http import LimitedBody, int_header
from protocol.versions import RESOLVED_HEADER, ResolvedVersions, short

from .errors import GatewayError
from .tracing import NO_TRACE, NoTrace

__all__ = [
    "ClientGone",
    "ClientStalled",
    "Reply",
    "Scope",
    "deadline_header",
    "header",
    "read_body",
    "send_error",
    "stamp_headers",
]

Scope = dict[str, Any]
_RESOLVED = RESOLVED_HEADER.encode()


class ClientGone(Exception):
    """The client disconnected while the body was being read."""


class ClientStalled(Exception):
    """The client took no bytes for longer than ``timeouts.client_stall_s``."""


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


async def read_body(scope: Scope, receive: Any, limit: int) -> bytes:
    """The request body, refusing more than ``limit`` bytes before reading them all."""
    body = LimitedBody(limit, header(scope, b"content-length"))
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        body.add(message.get("body", b""))
        if not message.get("more_body", False):
            return body.body()


def deadline_header(scope: Scope) -> int | None:
    """``x-sluice-deadline-ms``: 1 to 18 ASCII digits, at least 1, or a 400 naming it."""
    return int_header("x-sluice-deadline-ms", header(scope, b"x-sluice-deadline-ms"),
                      minimum=1, unit=" (milliseconds)")


def stamp_headers(stamp: ResolvedVersions | None,
                  request: Mapping[str, str] | None = None) -> list[tuple[bytes, bytes]]:
    """``x-sluice-resolved``: the server's versions, then the request's own (``schema=``,
    ``tools=``: sha256 of their canonical JSON), shortened as the server's hashes are."""
    if stamp is None:
        return []
    value = stamp.header_value()
    if request:
        value += "".join(f"; {name}={short(sha)}" for name, sha in request.items())
    return [(_RESOLVED, value.encode("latin-1", "replace"))]


class Reply:
    """The client's side of the exchange (see the module docstring)."""

    __slots__ = ("error", "metrics", "request_id", "route", "send", "started", "status", "tenant",
                 "trace")

    def __init__(self, send: Any, request_id: str, route: str, metrics: Any,
                 trace: NoTrace = NO_TRACE) -> None:
        self.send = send
        self.request_id = request_id
        self.route = route
        self.metrics = metrics
        self.trace = trace
        self.tenant = "-"
        self.started = False
        self.status = 0
        self.error: GatewayError | None = None  # what the client was told went wrong

    def failed(self, err: GatewayError) -> None:
        """Record the error the client gets (as a response or an in-stream event)."""
        self.trace.error(err)
        self.error = detached(err)  # no traceback: its frames would hold the request's body

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        headers.append((b"x-request-id", self.request_id.encode()))
        self.metrics.observe_response(self.route, self.tenant, status)
        self.started = True
        self.status = status
        await self.send({"type": "http.response.start", "status": status, "headers": headers})


async def send_error(reply: Reply, err: GatewayError, stamp: ResolvedVersions | None,
                     request: Mapping[str, str] | None = None) -> None:
    body = err.json_bytes()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += stamp_headers(stamp, request) + err.headers()
    reply.failed(err)
    await reply.start(err.status, headers)
    await reply.send({"type": "http.response.body", "body": body, "more_body": False})
