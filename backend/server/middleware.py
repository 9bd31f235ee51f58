"""Pure ASGI middleware (no BaseHTTPMiddleware: it would buffer and break streaming)."""

from __future__ import annotations

import uuid
from typing import Any

from protocol.http import clean_request_id
from protocol.versions import RESOLVED_HEADER

from .responses import Message, Receive, Scope, Send

_RESOLVED = RESOLVED_HEADER.encode()
# scope["state"] key: bytes a request appends to x-sluice-resolved ("; schema=…; tools=…")
RESOLVED_SUFFIX = "resolved_suffix"
_KNOWN_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models",
                           "/v1/tokenize", "/v1/state", "/metrics", "/health"})


class RequestContextMiddleware:
    """Accepts or makes ``x-request-id`` (kept in ``scope["state"]["request_id"]``) and
    adds it, plus ``x-sluice-resolved``, to every response; counts responses by route. A
    request's own versions (its schema's, its tools') are appended to ``x-sluice-resolved``
    from ``scope["state"][RESOLVED_SUFFIX]``, set before the response starts."""

    def __init__(self, app: Any, app_state: Any) -> None:
        self.app = app
        self.app_state = app_state  # Starlette's app.state, filled in by the lifespan

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        wanted = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                wanted = clean_request_id(value)
                break
        request_id = wanted or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        scope["state"]["client_request_id"] = wanted
        service = getattr(self.app_state, "service", None)
        state = scope["state"]
        path = scope.get("path", "")
        route = path if path in _KNOWN_ROUTES else "other"

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = [(b"x-request-id", request_id.encode())]
                if service is not None:
                    suffix: bytes = state.get(RESOLVED_SUFFIX, b"")
                    extra.append((_RESOLVED, service.resolved_header + suffix))
                message["headers"] = list(message.get("headers", ())) + extra
                if service is not None:
                    service.metrics.observe_http(route, message["status"])
            await send(message)

        await self.app(scope, receive, send_with_headers)
