"""The HTTP edge both Sluice servers share: request ids, request bodies, error responses.

``exception_handlers`` is what either Starlette app hands to ``Starlette(...)``: an unknown
route is a 404 and a wrong method a 405 in OpenAI's error shape, and an exception nobody
caught is a 500 that names the request id and logs the traceback, never showing it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from .errors import (
    ApiError,
    BadRequest,
    InternalError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
)

MAX_REQUEST_ID_LEN = 128
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


class LimitedBody:
    """Collects a request body, refusing (413) more than ``limit`` bytes: at once when the
    declared ``content-length`` is over, else as soon as the bytes read are."""

    __slots__ = ("_parts", "limit", "size")

    def __init__(self, limit: int, content_length: bytes | str | None = None) -> None:
        self.limit = limit
        self.size = 0
        self._parts: list[bytes] = []
        if content_length is not None and content_length.isdigit() \
                and int(content_length) > limit:
            raise PayloadTooLarge(f"the request body is {int(content_length)} bytes; "
                                  f"the limit is {limit}")

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            raise PayloadTooLarge(f"the request body exceeds the limit of {self.limit} bytes")
        self._parts.append(chunk)

    def body(self) -> bytes:
        return b"".join(self._parts)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A body that must be a JSON object; raises BadRequest (``invalid_json``) otherwise."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise BadRequest(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object", code="invalid_json")
    return body


def error_response(err: ApiError) -> Response:
    """An error in OpenAI's shape, with its retry and rate-limit headers."""
    response = Response(err.json_bytes(), status_code=err.status,
                        media_type="application/json")
    response.raw_headers.extend(err.headers())
    return response


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

    return {HTTPException: http_exception, Exception: unhandled}
