"""Errors a Sluice server answers with, always in OpenAI's shape.

    ApiError                        status + OpenAI ``type`` / ``code`` / ``param`` + headers
    ├── BadRequest                  400 invalid_request_error (bad JSON, text, types, field)
    │   ├── ContextLengthExceeded   400 code=context_length_exceeded
    │   └── RevisionMismatch        400 code=revision_mismatch, x-should-retry: false
    ├── AuthenticationFailed        401 code=invalid_api_key (a tenant's key, the backend's key)
    ├── ModelNotFound               404 code=model_not_found
    ├── NotFound                    404 (unknown route)
    ├── MethodNotAllowed            405
    ├── RequestTimeout              408 code=request_timeout (a head or body sent too slowly)
    ├── PayloadTooLarge             413 code=request_too_large
    ├── RateLimited                 429 rate_limit_error + Retry-After (a tenant over its share)
    ├── HeadTooLarge                431 code=request_header_too_large
    ├── ServiceUnavailable          503 (+ Retry-After when known: overload, draining)
    └── InternalError               500 (a bug; never for bad input, never a stack trace)

The gateway and the bundled backend derive their own errors from ``ApiError`` (the gateway's
403/429/502/504 in ``gateway/errors.py``, the engine's translation in
``backend/server/errors.py``).

Retry hints: ``retry-after-ms`` is the wait rounded up to a whole millisecond (at least 1)
and ``retry-after`` that same figure rounded up to whole seconds, so the two never disagree
(``retry-after == ceil(retry-after-ms / 1000)``). The OpenAI SDKs read ``retry-after-ms``
first; a hint of 0 would make them fall back to their own backoff, hence the floor of 1.
"""

from __future__ import annotations

import copy
import json
import math
from typing import TypeVar

# A wait computed as 0.1 s is 100.00000000000001 ms in floating point: do not round that up.
_MS_SLACK = 1e-6


def retry_after_headers(wait_s: float) -> list[tuple[bytes, bytes]]:
    """``retry-after`` (whole seconds) and ``retry-after-ms`` for a wait, both rounded up."""
    ms = max(1, math.ceil(wait_s * 1000 - _MS_SLACK))
    return [(b"retry-after", str(-(-ms // 1000)).encode()),
            (b"retry-after-ms", str(ms).encode())]


class ApiError(Exception):
    """The base of every error answered in OpenAI's shape."""

    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, *, code: str | None = None,
                 retry_after_s: float | None = None, should_retry: bool | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after_s = retry_after_s
        self.should_retry = should_retry
        self.extra_headers: list[tuple[bytes, bytes]] = []  # e.g. x-ratelimit-*

    def body(self) -> dict[str, dict[str, object]]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code,
                          "param": self.param}}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()

    def headers(self) -> list[tuple[bytes, bytes]]:
        """Retry hints (see the module docstring), ``x-should-retry``, then the extras."""
        out = [] if self.retry_after_s is None else retry_after_headers(self.retry_after_s)
        if self.should_retry is not None:
            out.append((b"x-should-retry", b"true" if self.should_retry else b"false"))
        return out + self.extra_headers


E = TypeVar("E", bound=BaseException)


def detached(err: E) -> E:
    """A copy of ``err`` to keep after the request (a reply's or a record's error): no
    traceback, cause or context. Their frames hold the request's body and lead back to the
    keeper, a cycle that keeps a large body alive until a GC pass; and ``err`` itself may
    still be propagating, so it is copied rather than cleared."""
    return copy.copy(err)  # BaseException.__reduce__ keeps args and __dict__, not those


class BadRequest(ApiError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(BadRequest):
    code = "context_length_exceeded"


class RevisionMismatch(BadRequest):
    """A ``model: "name@revision"`` pin that the served revision does not match."""

    code = "revision_mismatch"

    def __init__(self, message: str) -> None:
        super().__init__(message, "model", should_retry=False)


class AuthenticationFailed(ApiError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class ModelNotFound(ApiError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class NotFound(ApiError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(ApiError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class RequestTimeout(ApiError):
    """The client took too long to send its request (protocol.server's read deadlines)."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class PayloadTooLarge(ApiError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RateLimited(ApiError):
    """A tenant over its share: its quota (gateway admission) or its concurrent
    tokenizations (``protocol.offload``)."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class HeadTooLarge(ApiError):
    status = 431
    type = "invalid_request_error"
    code = "request_header_too_large"


class ServiceUnavailable(ApiError):
    status = 503
    type = "server_error"
    code = "service_unavailable"


class InternalError(ApiError):
    status = 500
    type = "server_error"
    code = "internal_error"
