"""Engine exceptions.

    EngineError
    ├── InvalidRequestError        bad input from the caller (the server maps it to 400)
    │   └── PromptTooLongError     prompt + max_tokens can never fit (max_model_len or KV capacity)
    ├── ModelLoadError             a checkpoint directory that cannot be served
    │   ├── MissingFileError       a file the checkpoint needs is absent (names it)
    │   └── UnsupportedModelError  an architecture or config feature we do not implement
    ├── TemplateError              the chat template failed to render
    └── EngineDeadError            the step loop crashed; no request can make progress
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


class ModelLoadError(EngineError):
    """The checkpoint cannot be loaded."""


class MissingFileError(ModelLoadError, FileNotFoundError):
    """A file the checkpoint needs is missing."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint asks for an architecture or feature the engine does not implement."""


class TemplateError(EngineError):
    """The chat template could not be rendered for these messages."""


class EngineDeadError(EngineError):
    """The engine's step loop failed; requests cannot progress."""
