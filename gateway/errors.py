"""Errors the gateway answers with, always in OpenAI's error shape.

    GatewayError                    status + OpenAI ``type`` / ``code`` / ``param`` + headers
    ├── BadRequest                  400 invalid_request_error (bad JSON, types, unsupported field)
    │   └── RevisionMismatch        400 code=revision_mismatch, x-should-retry: false
    ├── AuthenticationFailed        401 code=invalid_api_key
    ├── PermissionDenied            403 (model or priority outside the tenant's policy)
    ├── ModelNotFound               404 code=model_not_found
    ├── NotFound                    404 (unknown route)
    ├── MethodNotAllowed            405
    ├── PayloadTooLarge             413 (body bytes or prompt tokens over the tenant's cap)
    ├── RateLimited                 429 + Retry-After (a tenant quota; admission.py)
    ├── BadGateway                  502 (the upstream failed: 5xx, broken answer)
    ├── ServiceUnavailable          503 + Retry-After (upstream unreachable, draining)
    ├── GatewayTimeout              504 (deadline passed, upstream silent past read timeout)
    └── InternalError               500 (a bug; never for bad input, never with a stack trace)

Dependency errors (httpx, pydantic, yaml) are translated where they are caught.
"""

from __future__ import annotations

import json
import math


class GatewayError(Exception):
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

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code,
                          "param": self.param}}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()

    def headers(self) -> list[tuple[bytes, bytes]]:
        out: list[tuple[bytes, bytes]] = []
        if self.retry_after_s is not None:
            wait = max(0.0, self.retry_after_s)
            out.append((b"retry-after", str(math.ceil(wait)).encode()))
            out.append((b"retry-after-ms", str(math.ceil(wait * 1000)).encode()))
        if self.should_retry is not None:
            out.append((b"x-should-retry", b"true" if self.should_retry else b"false"))
        return out + self.extra_headers


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class RevisionMismatch(BadRequest):
    code = "revision_mismatch"

    def __init__(self, message: str) -> None:
        super().__init__(message, "model", should_retry=False)


class AuthenticationFailed(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class PermissionDenied(GatewayError):
    status = 403
    type = "invalid_request_error"
    code = "permission_denied"


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class BadGateway(GatewayError):
    status = 502
    type = "server_error"
    code = "upstream_error"


class GatewayTimeout(GatewayError):
    status = 504
    type = "server_error"
    code = "timeout"


class ServiceUnavailable(GatewayError):
    status = 503
    type = "server_error"
    code = "service_unavailable"


class InternalError(GatewayError):
    status = 500
    type = "server_error"
    code = "internal_error"


class ConfigError(Exception):
    """A gateway or tenants file that cannot be used; the message names the file and field."""
