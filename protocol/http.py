"""The HTTP edge both Sluice servers share: request ids, request bodies, numeric headers,
error responses.

Malformed input is a 400 here, never a 500 later: JSON bodies are parsed strictly
(``json_body``: UTF-8, no lone surrogates, at most ``MAX_JSON_DEPTH`` levels), and a header
that carries a number (``int_header``) is 1 to ``MAX_HEADER_DIGITS`` ASCII digits or a 400
naming it (``str.isdigit`` takes "²", and ``int()`` refuses over 4300 digits).

``exception_handlers`` is what either Starlette app hands to ``Starlette(...)``: an unknown
route is a 404 and a wrong method a 405 in OpenAI's error shape, a client gone while its
body was read (``ClientDisconnect``) ends the request quietly (``NoAnswer``), and an
exception nobody caught is a 500 that names the request id and logs the traceback, never
showing it.
"""

from __future__ import annotations

import email.utils
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from .errors import (
    ApiError,
    BadRequest,
    InternalError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
)
from .json_body import MAX_JSON_DEPTH, loads_strict, require_object

MAX_REQUEST_ID_LEN = 128
MAX_HEADER_DIGITS = 18  # every such number fits an int64; no real header needs more
ExceptionHandler = Callable[[Request, Exception], Awaitable[Response]]


def clean_request_id(raw: bytes | None) -> str | None:
    """The client's x-request-id if it is short printable ASCII, else None (we make one)."""
    if not raw or len(raw) > MAX_REQUEST_ID_LEN:
        return None
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        return None
    return text if text.isprintable() and text.strip() == text else None


def digits(raw: bytes | str | None, max_digits: int = MAX_HEADER_DIGITS) -> int | None:
    """The number a header value holds: 1 to ``max_digits`` ASCII digits (spaces and tabs
    around them ignored); None when absent or anything else (for headers we may ignore)."""
    if raw is None:
        return None
    if isinstance(raw, str):
        raw = raw.encode("latin-1", "replace")  # how Starlette decoded it; else not a digit
    raw = raw.strip(b" \t")
    if not 0 < len(raw) <= max_digits or not raw.isdigit():  # bytes.isdigit: ASCII only
        return None
    return int(raw)


def retry_after_s(headers: Mapping[str, str], default: float = 1.0, *,
                  now: float | None = None, max_digits: int = 9) -> float:
    """The wait a 429/503 asks for, in seconds: ``retry-after-ms`` (Sluice and OpenAI send
    it), else ``retry-after`` as delta-seconds or an HTTP date (RFC 9110 10.2.3); ``default``
    when none is usable. A date in the past is 0."""
    ms = digits(headers.get("retry-after-ms"), max_digits)
    if ms is not None:
        return ms / 1000
    raw = headers.get("retry-after")
    seconds = digits(raw, max_digits)
    if seconds is not None:
        return float(seconds)
    if not raw:
        return default
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return default
    if when.tzinfo is None:  # not an IMF-fixdate (those name GMT)
        return default
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def int_header(name: str, raw: bytes | str | None, *, minimum: int = 0,
               max_digits: int = MAX_HEADER_DIGITS, unit: str = "") -> int | None:
    """Header ``name``'s integer, at least ``minimum``; None when absent. Anything but 1 to
    ``max_digits`` ASCII digits is a 400 naming the header."""
    if raw is None:
        return None
    value = digits(raw, max_digits)
    if value is None or value < minimum:
        what = {0: "a non-negative integer", 1: "a positive integer"}.get(
            minimum, f"an integer >= {minimum}")
        raise BadRequest(f"{name} must be {what}{unit}: 1 to {max_digits} ASCII digits",
                         name, code="invalid_value")
    return value


class LimitedBody:
    """Collects a request body, refusing (413) more than ``limit`` bytes: at once when the
    declared ``content-length`` is over, else as soon as the bytes read are. A
    ``content-length`` that is not 1-18 ASCII digits is a 400 naming it (uvicorn's parser
    refuses most such heads before the app; this holds whatever server is in front)."""

    __slots__ = ("_parts", "limit", "size")

    def __init__(self, limit: int, content_length: bytes | str | None = None) -> None:
        self.limit = limit
        self.size = 0
        self._parts: list[bytes] = []
        declared = int_header("content-length", content_length)
        if declared is not None and declared > limit:
            raise PayloadTooLarge(f"the request body is {declared} bytes; the limit is {limit}")

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            raise PayloadTooLarge(f"the request body exceeds the limit of {self.limit} bytes")
        self._parts.append(chunk)

    def body(self) -> bytes:
        return b"".join(self._parts)


def parse_json_object(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """A body that must be a JSON object, parsed strictly (``json_body.loads_strict``);
    raises BadRequest (``invalid_json``, or ``invalid_unicode`` naming the field)."""
    return require_object(loads_strict(raw, max_depth))


def error_response(err: ApiError) -> Response:
    """An error in OpenAI's shape, with its retry and rate-limit headers."""
    response = Response(err.json_bytes(), status_code=err.status,
                        media_type="application/json")
    response.raw_headers.extend(err.headers())
    return response


class NoAnswer(Response):
    """The answer to a request whose client has gone while its body was read (Starlette's
    ``ClientDisconnect``): nothing is sent. The client left, or protocol.server cut a body
    sent too slowly and answered 408 itself; uvicorn logs nothing for a request whose client
    is gone and that sends nothing, and no status is counted. A quiet end, as the gateway's
    ``ClientGone``; never a 500 and a traceback."""

    def __init__(self) -> None:
        super().__init__(status_code=499)  # never sent: nginx's "client closed request"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        return None


def _request_id(request: Request) -> Any:
    state: Mapping[str, Any] = request.scope.get("state") or {}
    return state.get("request_id")


def exception_handlers(log: logging.Logger) -> dict[Any, ExceptionHandler]:
    """Starlette's ``exception_handlers`` for a Sluice app (see the module docstring)."""

    async def http_exception(request: Request, exc: Exception) -> Response:
        if not isinstance(exc, HTTPException):
            return await unhandled(request, exc)
        if exc.status_code == 404:
            return error_response(NotFound(f"no route {request.url.path}"))
        if exc.status_code == 405:
            return error_response(MethodNotAllowed(f"{request.method} is not allowed on "
                                                   f"{request.url.path}"))
        err = ApiError(str(exc.detail))
        err.status = exc.status_code
        return error_response(err)

    async def unhandled(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(InternalError(f"internal error ({type(exc).__name__}); "
                                            f"request id {_request_id(request)}"))

    async def client_gone(request: Request, exc: Exception) -> Response:
        return NoAnswer()  # a handler's body read ended in http.disconnect: a quiet end

    return {HTTPException: http_exception, ClientDisconnect: client_gone, Exception: unhandled}
