"""The exact versions behind an answer: model, weights revision, tokenizer, template, engine.

Every response reports them (`x-sluice-resolved` header, `system_fingerprint`), and the prefix
cache salts its hash chain with them, so that KV blocks computed under one tokenizer or template
are never reused under another.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import string
from dataclasses import asdict, dataclass, field
from functools import lru_cache

FALLBACK_VERSION = "0.1.0"
SHORT_HASH_LEN = 12
_HEX = frozenset(string.hexdigits.lower())
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


def short_hash(value: str) -> str:
    """First 12 characters of a hex digest; any other value (a branch name, "none") unchanged."""
    if len(value) > SHORT_HASH_LEN and set(value.lower()) <= _HEX:
        return value[:SHORT_HASH_LEN]
    return value


def _field_bytes(value: str | None) -> bytes:
    # Tagged and length-prefixed, so distinct field tuples never hash the same bytes
    # (None vs "" vs "none", or a boundary moved between two fields).
    if value is None:
        return b"\x00"
    data = value.encode("utf-8")
    return b"\x01" + len(data).to_bytes(8, "big") + data


@dataclass(slots=True, frozen=True)
class ResolvedVersions:
    """Full values in the fields (hex digests, not prefixes)."""

    model: str
    revision: str
    tokenizer: str
    chat_template: str | None
    engine: str = field(default_factory=engine_version)

    def header_value(self) -> str:
        """`model=…; revision=…; tokenizer=…; chat_template=…; engine=…`, hashes shortened."""
        template = "none" if self.chat_template is None else short_hash(self.chat_template)
        return (
            f"model={self.model}; revision={short_hash(self.revision)}; "
            f"tokenizer={short_hash(self.tokenizer)}; chat_template={template}; "
            f"engine={self.engine}"
        )

    def fingerprint(self) -> str:
        """`fp_` + 12 hex of a sha256 over every field (OpenAI's system_fingerprint shape)."""
        digest = hashlib.sha256(b"sluice/fingerprint/v1")
        for value in (self.model, self.revision, self.tokenizer, self.chat_template, self.engine):
            digest.update(_field_bytes(value))
        return "fp_" + digest.hexdigest()[:SHORT_HASH_LEN]

    def as_dict(self) -> dict[str, str | None]:
        return asdict(self)

    def prefix_cache_salt(self, cache_salt: str | None) -> bytes:
        """The 32-byte root of the prefix-cache hash chain for a request.

        Mixes the request's cache_salt with the revision, tokenizer and chat template. None and ""
        both mean "no salt" and give the same root, which no non-empty salt can produce.
        """
        digest = hashlib.sha256(_PREFIX_ROOT_DOMAIN)
        digest.update(_field_bytes(cache_salt or None))
        for value in (self.revision, self.tokenizer, self.chat_template):
            digest.update(_field_bytes(value))
        return digest.digest()
