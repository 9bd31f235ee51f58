"""The bundled backend's API key: every route but ``/health`` needs ``Bearer KEY``.

Without it, anyone who reaches the backend's port could generate past every quota, read
the engine's state (``/v1/state``: running, waiting, prefix-cache hits; ``/metrics``) and
send any ``cache_salt`` to time another tenant's prefix-cache hits. The gateway sends the
key (``api_key_env`` of its model entry); ``sluice up`` makes a fresh one per run. The salt
the gateway derives is an HMAC under a key of its own (``gateway/cache_salt.py``), so the
two together close the timing channel: the port is closed, and a salt cannot be forged.

``/health`` stays open: load balancers, Docker's HEALTHCHECK and the gateway's probes read
it without credentials, and it says only whether the server is up. ``/metrics`` is guarded
like the rest (Prometheus sends the key: ``authorization.credentials_file``).

The comparison is of SHA-256 digests with ``hmac.compare_digest``: constant time, and
independent of the presented key's length.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from typing import Any

from protocol.errors import AuthenticationFailed
from protocol.http import error_response

from .responses import Receive, Scope, Send

API_KEY_ENV = "SLUICE_BACKEND_API_KEY"
OPEN_PATHS = frozenset({"/health"})


def check_key(key: str) -> str:
    """``key`` if it can travel in an ``Authorization`` header (printable ASCII, no spaces)."""
    if not key:
        raise ValueError("the API key is empty")
    if not all("!" <= c <= "~" for c in key):
        raise ValueError("the API key must be printable ASCII without spaces")
    return key


def resolve_api_key(flag: str | None, no_key: bool, env: Mapping[str, str]) -> str | None:
    """The key ``sluice backend`` serves with: ``--api-key``, else ``$SLUICE_BACKEND_API_KEY``;
    None only with an explicit ``--no-api-key``. Raises ``ValueError`` otherwise."""
    if no_key:
        if flag is not None:
            raise ValueError("give --api-key or --no-api-key, not both")
        return None
    key = flag if flag is not None else env.get(API_KEY_ENV)
    if key is None or key == "":
        raise ValueError(f"no API key: give --api-key KEY or set {API_KEY_ENV} (the gateway "
                       f"sends it; see docs/backend.md), or --no-api-key to serve anyone "
                       f"who reaches the port (local experiments only)")
    return check_key(key)


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class ApiKeyMiddleware:
    """Pure ASGI: refuses a request without the key with 401 ``invalid_api_key``, before
    its body is read. Passes ``send`` through untouched (no cost per streamed chunk)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self._digest = _digest(check_key(api_key).encode())

    def allows(self, headers: list[tuple[bytes, bytes]]) -> bool | None:
        """True for the right key, False for a wrong one, None when none is presented."""
        for name, value in headers:
            if name == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                if scheme.lower() != b"bearer":
                    return False
                return hmac.compare_digest(_digest(token.strip()), self._digest)
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        verdict = self.allows(scope["headers"])
        if verdict:
            await self.app(scope, receive, send)
            return
        err = AuthenticationFailed(
            "no API key: this server needs 'Authorization: Bearer <key>', the key it was "
            "started with" if verdict is None else "invalid API key")
        err.extra_headers.append((b"www-authenticate", b"Bearer"))
        await error_response(err)(scope, receive, send)
