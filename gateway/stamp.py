"""What every answer is stamped with: the exact versions that produced it.

``x-sluice-resolved: model=…; revision=…; tokenizer=…; chat_template=…; engine=…; policy=…``
and, in the body, ``system_fingerprint`` = ``fp_`` + 12 hex of a hash over all six fields.
"""

from __future__ import annotations

import hashlib
import string
from dataclasses import dataclass
from typing import Any

SHORT = 12
_HEX = frozenset(string.hexdigits.lower())


def short(value: str | None) -> str:
    """A hex digest shortened to 12 characters; other values ("unknown", a tag) unchanged."""
    if value is None:
        return "none"
    if len(value) > SHORT and set(value.lower()) <= _HEX:
        return value[:SHORT]
    return value


@dataclass(slots=True, frozen=True)
class UpstreamVersions:
    """Versions of what an upstream serves (full hex digests where it reports them)."""

    revision: str
    tokenizer: str
    chat_template: str | None
    engine: str

    @classmethod
    def from_report(cls, resolved: dict[str, Any]) -> UpstreamVersions:
        """From the bundled backend's ``/v1/models`` entry ``resolved`` object."""
        def text(name: str) -> str:
            value = resolved.get(name)
            return value if isinstance(value, str) and value else "unknown"

        template = resolved.get("chat_template")
        return cls(revision=text("revision"), tokenizer=text("tokenizer"),
                   chat_template=template if isinstance(template, str) else None,
                   engine=text("engine"))

    def revision_matches(self, pin: str) -> bool:
        """A pin matches the full revision, or a prefix of at least 7 characters of it."""
        rev = self.revision
        return bool(pin) and (pin == rev or (len(pin) >= 7 and rev.startswith(pin)))


@dataclass(slots=True, frozen=True)
class Stamp:
    model: str
    versions: UpstreamVersions
    policy: str

    def header_value(self) -> str:
        v = self.versions
        return (f"model={self.model}; revision={short(v.revision)}; "
                f"tokenizer={short(v.tokenizer)}; chat_template={short(v.chat_template)}; "
                f"engine={v.engine}; policy={self.policy}")

    def fingerprint(self) -> str:
        digest = hashlib.sha256(b"sluice/gateway-fingerprint/v1")
        v = self.versions
        for value in (self.model, v.revision, v.tokenizer, v.chat_template, v.engine,
                      self.policy):
            data = b"\x00" if value is None else b"\x01" + value.encode()
            digest.update(len(data).to_bytes(8, "big") + data)
        return "fp_" + digest.hexdigest()[:SHORT]
