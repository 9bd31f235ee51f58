"""Engine exceptions.

    EngineError
    ├── InvalidRequestError        bad input from the caller (the server maps it to 400)
    │   └── PromptTooLongError     prompt + max_tokens can never fit (max_model_len or KV capacity)
    └── EngineDeadError            the step loop crashed; no request can make progress

A checkpoint that cannot be served, or a chat template that fails, raises the errors of
``modelfiles.errors`` (ModelLoadError and its subclasses, TemplateError, InvalidMessagesError):
the engine reads the same files as everyone else and passes those errors on unchanged.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """The request itself is wrong; retrying it unchanged cannot succeed."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus the tokens it asks for) can never fit in this engine."""


class EngineDeadError(EngineError):
    """The engine's step loop failed; requests cannot progress."""
