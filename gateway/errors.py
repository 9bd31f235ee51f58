"""Errors the gateway answers with, always in OpenAI's shape.

``protocol.errors`` holds the base class and the errors both Sluice servers answer with;
this module adds the gateway's own. ``GatewayError`` is the gateway's name for the base.

    GatewayError (= protocol.errors.ApiError)
    ├── BadRequest                  400 (bad JSON, types, unsupported field)       protocol
    │   ├── ContextLengthExceeded   400 code=context_length_exceeded               protocol
    │   └── RevisionMismatch        400 code=revision_mismatch, x-should-retry     protocol
    ├── AuthenticationFailed        401 code=invalid_api_key                       protocol
    ├── PermissionDenied            403 (model or priority outside the tenant's policy)
    ├── ModelNotFound               404 code=model_not_found                       protocol
    ├── NotFound                    404 (unknown route)                            protocol
    ├── MethodNotAllowed            405                                            protocol
    ├── PayloadTooLarge             413 (body bytes or prompt tokens over the cap) protocol
    ├── RateLimited                 429 + Retry-After (quota, tokenizations)       protocol
    ├── BadGateway                  502 (the upstream failed: 5xx, broken answer)
    ├── ServiceUnavailable          503 + Retry-After (unreachable, draining)      protocol
    │   └── RevisionUnavailable     503 code=revision_unavailable (no member serves the pin)
    ├── GatewayTimeout              504 (deadline passed, upstream silent past read timeout)
    └── InternalError               500 (a bug; never for bad input)               protocol

Dependency errors (httpx, pydantic, yaml) are translated where they are caught.
"""

from __future__ import annotations

from protocol.errors import ApiError as GatewayError
from protocol.errors import (
    AuthenticationFailed,
    BadRequest,
    ContextLengthExceeded,
    InternalError,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    PayloadTooLarge,
    RevisionMismatch,
    ServiceUnavailable,
)

__all__ = [
    "AuthenticationFailed",
    "BadGateway",
    "BadRequest",
    "ConfigError",
    "ContextLengthExceeded",
    "GatewayError",
    "GatewayTimeout",
    "InternalError",
    "MethodNotAllowed",
    "ModelNotFound",
    "NotFound",
    "PayloadTooLarge",
    "PermissionDenied",
    "RevisionMismatch",
    "RevisionUnavailable",
    "ServiceUnavailable",
]


class PermissionDenied(GatewayError):
    status = 403
    type = "invalid_request_error"
    code = "permission_denied"


class BadGateway(GatewayError):
    status = 502
    type = "server_error"
    code = "upstream_error"


class RevisionUnavailable(ServiceUnavailable):
    """A pinned revision no member of the pool is known to serve now (Retry-After: the
    refresh interval, the soonest the gateway can learn that one does)."""

    code = "revision_unavailable"


class GatewayTimeout(GatewayError):
    status = 504
    type = "server_error"
    code = "timeout"


class ConfigError(Exception):
    """A gateway or tenants file that cannot be used; the message names the file and field."""
