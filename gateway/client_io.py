"""The client's side of a generation request: reading the request, writing the answer.

``Reply`` is what the relay writes through: ``start`` adds ``x-request-id`` and counts the
status, body messages go to the server's ``send`` through one wrapper, the stall timeout
(``endpoint.bounded_send``).
"""

from __future__ import annotations

import json
from typing import Any

from .errors import BadRequest, GatewayError, PayloadTooLarge
from .sse import DONE, dumps
from .stamp import Stamp
from .tracing import NO_TRACE, NoTrace

Scope = dict[str, Any]
MAX_REQUEST_ID_LEN = 128


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
    length = header(scope, b"content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLarge(f"the request body is {int(length)} bytes; your limit is {limit}")
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the request body exceeds your limit of {limit} bytes")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise BadRequest(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object", code="invalid_json")
    return body


def deadline_header(scope: Scope) -> int | None:
    raw = header(scope, b"x-sluice-deadline-ms")
    if raw is None:
        return None
    text = raw.decode("latin-1").strip()
    if not text.isdigit() or int(text) < 1:
        raise BadRequest("x-sluice-deadline-ms must be a positive integer (milliseconds)",
                         "x-sluice-deadline-ms", code="invalid_value")
    return int(text)


def stamp_headers(stamp: Stamp | None) -> list[tuple[bytes, bytes]]:
    if stamp is None:
        return []
    return [(b"x-sluice-resolved", stamp.header_value().encode("latin-1", "replace"))]


def clean_request_id(raw: bytes | None) -> str | None:
    """The client's x-request-id if it is short printable ASCII, else None (we make one)."""
    if not raw or len(raw) > MAX_REQUEST_ID_LEN:
        return None
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        return None
    return text if text.isprintable() and text.strip() == text else None


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
        self.error = err
        self.trace.error(err)

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        headers.append((b"x-request-id", self.request_id.encode()))
        self.metrics.observe_response(self.route, self.tenant, status)
        self.started = True
        self.status = status
        await self.send({"type": "http.response.start", "status": status, "headers": headers})


async def send_error(reply: Reply, err: GatewayError, stamp: Stamp | None) -> None:
    body = err.json_bytes()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += stamp_headers(stamp) + err.headers()
    reply.failed(err)
    await reply.start(err.status, headers)
    await reply.send({"type": "http.response.body", "body": body, "more_body": False})


def error_event(err: GatewayError) -> bytes:
    """An in-stream error (headers already sent); the openai SDK raises APIError on it."""
    payload = err.body()
    payload["error"]["status"] = err.status  # type: ignore[index]
    return b"data: " + dumps(payload).encode() + b"\n\n" + DONE
