"""HTTP errors of the bundled model server, always sent in OpenAI's error shape.

The error classes are ``protocol.errors``'s, the same the gateway answers with (``ApiError``
and its tree: BadRequest, ContextLengthExceeded, ModelNotFound, NotFound, MethodNotAllowed,
PayloadTooLarge, ServiceUnavailable for a dead engine or a draining server, InternalError).
What is the backend's own is the translation at the boundary: engine exceptions by
``from_engine_error``, tokenizer and chat template ones (modelfiles) by
``from_model_file_error``.
"""

from __future__ import annotations

from backend.engine.errors import (
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    PromptTooLongError,
)
from modelfiles.errors import InvalidMessagesError, ModelFileError, TemplateError
from protocol.errors import (
    ApiError,
    BadRequest,
    ContextLengthExceeded,
    InternalError,
    ServiceUnavailable,
)


def from_engine_error(exc: EngineError) -> ApiError:
    """Map an engine exception to the HTTP error the client should see."""
    if isinstance(exc, PromptTooLongError):
        return ContextLengthExceeded(str(exc), exc.param)
    if isinstance(exc, InvalidRequestError):
        return BadRequest(str(exc), exc.param)
    if isinstance(exc, EngineDeadError):
        return ServiceUnavailable(str(exc))
    return InternalError(f"{type(exc).__name__}: {exc}")


def from_model_file_error(exc: ModelFileError) -> ApiError:
    """Map a tokenizer or chat template exception to the HTTP error the client should see."""
    if isinstance(exc, InvalidMessagesError):
        return BadRequest(str(exc), exc.param)
    if isinstance(exc, TemplateError):
        return BadRequest(f"chat template: {exc}", "messages", code="invalid_messages")
    return InternalError(f"{type(exc).__name__}: {exc}")
