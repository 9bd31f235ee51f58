"""HTTP errors of the bundled model server, always sent in OpenAI's error shape.

    ApiError                      status + OpenAI ``type`` / ``code`` / ``param``
    ├── BadRequest                400 invalid_request_error (bad JSON, wrong types, bad values)
    │   └── ContextLengthExceeded 400 code=context_length_exceeded
    ├── ModelNotFound             404 code=model_not_found
    ├── NotFound                  404 (unknown route)
    ├── MethodNotAllowed          405
    ├── PayloadTooLarge           413 code=request_too_large
    ├── Unavailable               503 (engine dead, server draining)
    └── InternalError             500 (a bug; never for bad input)

Engine exceptions are translated at the boundary by ``from_engine_error``.
"""

from __future__ import annotations

import json
import math

from backend.engine.errors import (
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    PromptTooLongError,
    TemplateError,
)


class ApiError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        """``retry-after`` (whole seconds, rounded up) and ``retry-after-ms``, when known."""
        if self.retry_after_s is None:
            return {}
        return {"retry-after": str(max(1, math.ceil(self.retry_after_s))),
                "retry-after-ms": str(max(1, round(self.retry_after_s * 1000)))}

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code,
                          "param": self.param}}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()


class BadRequest(ApiError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(BadRequest):
    code = "context_length_exceeded"


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


class PayloadTooLarge(ApiError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class Unavailable(ApiError):
    status = 503
    type = "server_error"
    code = "service_unavailable"


class InternalError(ApiError):
    status = 500
    type = "server_error"
    code = "internal_error"


def from_engine_error(exc: EngineError) -> ApiError:
    """Map an engine exception to the HTTP error the client should see."""
    if isinstance(exc, PromptTooLongError):
        return ContextLengthExceeded(str(exc), exc.param)
    if isinstance(exc, InvalidRequestError):
        return BadRequest(str(exc), exc.param)
    if isinstance(exc, TemplateError):
        return BadRequest(f"chat template: {exc}", "messages", code="invalid_messages")
    if isinstance(exc, EngineDeadError):
        return Unavailable(str(exc))
    return InternalError(f"{type(exc).__name__}: {exc}")
