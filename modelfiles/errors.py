"""Errors of the model-file code.

    ModelFileError                  base class of every error modelfiles raises on purpose
    ├── ModelLoadError              a checkpoint directory that cannot be served
    │   ├── MissingFileError        a file the checkpoint needs is absent (names it)
    │   └── UnsupportedModelError   an architecture or config feature Sluice does not implement
    ├── TemplateError               the chat template failed to render these messages
    └── InvalidMessagesError        chat messages no template can take (``param="messages"``)

The engine raises these unchanged: it loads the same files. Each caller translates them at its
own boundary: the backend server and the gateway's token counter answer TemplateError and
InvalidMessagesError with a 400, `sluice backend` and `sluice plan` report a ModelLoadError.
"""

from __future__ import annotations


class ModelFileError(Exception):
    """Base class of every error modelfiles raises on purpose."""


class ModelLoadError(ModelFileError):
    """The checkpoint cannot be loaded."""


class MissingFileError(ModelLoadError, FileNotFoundError):
    """A file the checkpoint needs is missing."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint asks for an architecture or feature Sluice does not implement."""


class TemplateError(ModelFileError):
    """The chat template could not be rendered for these messages."""


class InvalidMessagesError(ModelFileError, ValueError):
    """The chat messages themselves are malformed; retrying them unchanged cannot succeed."""

    def __init__(self, message: str, param: str | None = "messages") -> None:
        super().__init__(message)
        self.param = param
