"""The gateway's side of the request contract (``protocol.contract``).

The models and the field policy are protocol's, the same the bundled backend applies. The
gateway differs in three ways: ``model`` is required; ``cache_salt`` is refused (the gateway
derives one per tenant itself); and ``priority`` and ``deadline_ms`` are served by the
gateway whatever the upstream (it forwards ``priority`` only to an upstream that has it).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, StrictStr

from protocol import contract
from protocol.contract import Kind

from .errors import BadRequest

__all__ = ["ChatRequest", "CompletionRequest", "Kind", "Request", "check_capabilities", "parse"]

GATEWAY_SERVES = frozenset({"priority"})  # deadline_ms: every Sluice server accepts it


class ChatRequest(contract.ChatRequest):
    model: StrictStr = Field(min_length=1)


class CompletionRequest(contract.CompletionRequest):
    model: StrictStr = Field(min_length=1)


Request = ChatRequest | CompletionRequest


def parse(kind: Kind, body: dict[str, Any]) -> Request:
    """Validate a body's types and ranges; raises BadRequest naming the field."""
    req: Request
    if kind == "chat":
        req = contract.validate(ChatRequest, body)
    else:
        req = contract.validate(CompletionRequest, body)
    if req.cache_salt is not None:
        raise BadRequest("cache_salt is chosen by the gateway for each tenant; do not send it",
                         "cache_salt", code="unsupported_parameter")
    return req


def check_capabilities(req: Request, model: str, capabilities: frozenset[str]) -> None:
    """Refuse a feature the model's upstream cannot honor (400 naming the field)."""
    contract.check_capabilities(req, model, capabilities | GATEWAY_SERVES)
