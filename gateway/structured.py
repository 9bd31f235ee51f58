"""A chat's structured-output and tool fields at the gateway (``response_format``, ``tools``,
``tool_choice``; ``protocol.structured`` says what they mean).

What the gateway does with them, for every upstream:

- **versions**: the SHA-256 of the schema's and of the tools' canonical JSON, stamped on the
  answer (``x-sluice-resolved: …; schema=<12 hex>; tools=<12 hex>``) and on the request's
  span (``sluice.schema_sha256``, ``sluice.tools_sha256``, full hex). They are the request's
  own versions, never mixed into ``system_fingerprint`` (the servers' versions alone).
- **counting**: the prompt is counted as the upstream renders it (``ChatExtras``): the
  tools by the chat template, and for the bundled backend the schema's instruction in the
  system message, so they count in the prompt tokens and in the worst case reserved.

For a ``kind: sluice`` upstream the fields are validated as the bundled backend will
(``structured_of``: a 400 naming the field, before anything is reserved). Another
OpenAI-compatible server validates them itself (it may serve what the bundled backend does
not: legacy ``functions``, other ``response_format`` types); the gateway only hashes what it
recognizes, the same values ``structured_of`` hashes, and renders the tools as given.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from protocol.contract import ChatRequest
from protocol.structured import (
    JSON_OBJECT_SCHEMA,
    NO_STRUCTURE,
    Structured,
    sha256_of,
    structured_of,
)


@dataclass(slots=True, frozen=True)
class ChatExtras:
    """What a chat's prompt is rendered with besides its messages: ``structured`` (its
    ``prompt_messages`` and ``template_tools``, what a local tokenizer renders) and the
    fields as the client sent them (what an upstream's ``/v1/tokenize`` is given, so that
    the server that renders the prompt is the one that counts it)."""

    structured: Structured = NO_STRUCTURE
    response_format: Mapping[str, Any] | None = None  # only where it asks for a format

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        return self.structured.template_tools()

    def versions(self) -> dict[str, str]:
        """``{"schema": sha256, "tools": sha256}``, the present ones (full hex)."""
        return self.structured.versions()


NO_EXTRAS = ChatExtras()


def chat_extras(req: ChatRequest, bundled: bool) -> ChatExtras:
    """A chat's extras for an upstream that is the bundled backend (``bundled``: validated
    as it will, a ``BadRequest`` naming the field) or another server (hashed and rendered
    as given, validated by that server)."""
    fmt = req.response_format
    asked = fmt if fmt is not None and fmt.get("type", "text") != "text" else None
    if bundled:
        return ChatExtras(structured_of(req), asked)
    if asked is None and not req.tools:
        return NO_EXTRAS
    schema = _schema(asked)
    return ChatExtras(Structured(
        schema_sha256=None if schema is None else sha256_of(schema),
        tools_sha256=sha256_of(req.tools) if req.tools else None,
        tools=tuple(req.tools or ())), asked)


def _schema(fmt: Mapping[str, Any] | None) -> Any:
    """The schema a response_format constrains to (None: none that is recognized)."""
    if fmt is None:
        return None
    if fmt.get("type") == "json_object":
        return JSON_OBJECT_SCHEMA
    spec = fmt.get("json_schema")
    if fmt.get("type") == "json_schema" and isinstance(spec, dict) and "schema" in spec:
        return spec["schema"]
    return None
