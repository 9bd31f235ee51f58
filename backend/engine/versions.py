"""The engine's part of the resolved versions (``protocol.versions.ResolvedVersions``): its
own version string, and the prefix-cache root salted with the versions, so that KV blocks
computed under one tokenizer or template are never reused under another.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from functools import lru_cache

from protocol.versions import ResolvedVersions, frame_field

from .config import QUANTIZATIONS

FALLBACK_VERSION = "0.1.0"
# Domain separation for the prefix-cache root; bump to invalidate every cached block.
_PREFIX_ROOT_DOMAIN = b"sluice/prefix-cache-root/v1"


@lru_cache(maxsize=8)
def engine_version(*features: str) -> str:
    """`sluice-engine/<installed sluice version>` (0.1.0 when not installed), then
    ``+<feature>`` for each engine feature that changes what is computed or how
    (``+spec-ngram-k4-b8``: speculative decoding's config), so a pin tells them apart."""
    try:
        version = importlib.metadata.version("sluice")
    except importlib.metadata.PackageNotFoundError:
        version = FALLBACK_VERSION
    return "".join((f"sluice-engine/{version}", *(f"+{f}" for f in features)))


def prefix_cache_salt(resolved: ResolvedVersions, cache_salt: str | None) -> bytes:
    """The 32-byte root of the prefix-cache hash chain for a request.

    Mixes the request's cache_salt with the revision, tokenizer and chat template. None and ""
    both mean "no salt" and give the same root, which no non-empty salt can produce. An
    engine feature that changes the K/V computed (weight quantization, named in the engine
    version: ``kv_features``) is mixed in after them; without one the root is as before.
    """
    v = resolved.versions
    digest = hashlib.sha256(_PREFIX_ROOT_DOMAIN)
    digest.update(frame_field(cache_salt or None))
    for value in (v.revision, v.tokenizer, v.chat_template, *kv_features(v.engine)):
        digest.update(frame_field(value))
    return digest.digest()


def kv_features(engine: str) -> tuple[str, ...]:
    """The ``+feature``s of an engine version that change what a KV block holds: the
    weight quantization (``sluice-engine/0.1.0+int8``; K/V come from other weights)."""
    return tuple(f for f in engine.split("+")[1:] if f in QUANTIZATIONS)
