"""The engine's part of the resolved versions (``protocol.versions.ResolvedVersions``): its
own version string, and the prefix-cache root salted with the versions, so that KV blocks
computed under one tokenizer or template are never reused under another.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from functools import lru_cache

from protocol.versions import ResolvedVersions, frame_field

FALLBACK_VERSION = "0.1.0"
# Domain separation for the prefix-cache root; bump to invalidate every cached block.
_PREFIX_ROOT_DOMAIN = b"sluice/prefix-cache-root/v1"


@lru_cache(maxsize=1)
def engine_version() -> str:
    """`sluice-engine/<installed sluice version>` (0.1.0 when not installed)."""
    try:
        version = importlib.metadata.version("sluice")
    except importlib.metadata.PackageNotFoundError:
        version = FALLBACK_VERSION
    return f"sluice-engine/{version}"


def prefix_cache_salt(resolved: ResolvedVersions, cache_salt: str | None) -> bytes:
    """The 32-byte root of the prefix-cache hash chain for a request.

    Mixes the request's cache_salt with the revision, tokenizer and chat template. None and ""
    both mean "no salt" and give the same root, which no non-empty salt can produce.
    """
    v = resolved.versions
    digest = hashlib.sha256(_PREFIX_ROOT_DOMAIN)
    digest.update(frame_field(cache_salt or None))
    for value in (v.revision, v.tokenizer, v.chat_template):
        digest.update(frame_field(value))
    return digest.digest()
