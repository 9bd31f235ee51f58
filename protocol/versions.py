"""The exact versions behind an answer, and how they are written on it.

Every answer carries them twice: the header

    x-sluice-resolved: model=…; revision=…; tokenizer=…; chat_template=…; engine=…[; policy=…]

(hex digests cut to 12 characters, a missing chat template written ``none``) and, in the
body, ``system_fingerprint`` = ``fp_`` + 12 hex of a sha256 over every field. The model
server stamps model, weights revision, tokenizer, chat template and engine; the gateway adds
the tenant's policy version. The two fingerprints hash under different domains and framings
(as they always have: clients compare fingerprints across releases, so these bytes are
frozen); ``policy`` set or not tells which one a ``ResolvedVersions`` is.
"""

from __future__ import annotations

import hashlib
import string
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

RESOLVED_HEADER = "x-sluice-resolved"
SHORT = 12
MIN_PIN = 7  # hex characters of a revision a pin may stop at (as git's short hashes)
_HEX = frozenset(string.hexdigits.lower())
_SERVER_DOMAIN = b"sluice/fingerprint/v1"
_GATEWAY_DOMAIN = b"sluice/gateway-fingerprint/v1"
_NONE = "none"


def short(value: str | None) -> str:
    """A hex digest cut to 12 characters; None is "none"; other values ("main", a tag) as is."""
    if value is None:
        return _NONE
    if len(value) > SHORT and set(value.lower()) <= _HEX:
        return value[:SHORT]
    return value


@dataclass(slots=True, frozen=True)
class ServedVersions:
    """What a model server serves, full values (hex digests, not prefixes)."""

    revision: str
    tokenizer: str
    chat_template: str | None
    engine: str

    @classmethod
    def from_report(cls, resolved: dict[str, Any]) -> ServedVersions:
        """From the ``resolved`` object of a Sluice server's ``/v1/models`` entry."""
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
        return bool(pin) and (pin == rev or (len(pin) >= MIN_PIN and rev.startswith(pin)))

    def pin_refusal(self, model: str, pin: str) -> str:
        """Why ``pin`` does not match (the revision_mismatch message): a pin too short to be
        a prefix says so, even where it is one, rather than claim another revision."""
        served = f"the model {model!r} is served at revision {self.revision[:SHORT]!r}"
        if pin != self.revision and len(pin) < MIN_PIN:
            return (f"{served}; a pin needs at least {MIN_PIN} hex characters of the revision "
                    f"(or all of it), and {pin!r} has {len(pin)}")
        return f"{served}, not {pin!r}"


@dataclass(slots=True, frozen=True)
class ResolvedVersions:
    """A model name, the versions it was served at, and (at the gateway) the policy."""

    model: str
    versions: ServedVersions
    policy: str | None = None
    # fingerprint() and header_value(), computed once: every answer of a version carries them
    _memo: tuple[str, str] | None = field(default=None, init=False, repr=False,
                                          compare=False)

    def _fields(self) -> tuple[str | None, ...]:
        v = self.versions
        head = (self.model, v.revision, v.tokenizer, v.chat_template, v.engine)
        return head if self.policy is None else (*head, self.policy)

    def header_value(self) -> str:
        """The ``x-sluice-resolved`` value, hashes shortened."""
        return (self._memo or self._remember())[1]

    def fingerprint(self) -> str:
        """``fp_`` + 12 hex of a sha256 over every field (OpenAI's system_fingerprint shape)."""
        return (self._memo or self._remember())[0]

    def _remember(self) -> tuple[str, str]:
        memo = (self._fingerprint(), self._header_value())
        object.__setattr__(self, "_memo", memo)  # frozen: a cache, not a field of the value
        return memo

    def _header_value(self) -> str:
        v = self.versions
        value = (f"model={self.model}; revision={short(v.revision)}; "
                 f"tokenizer={short(v.tokenizer)}; chat_template={short(v.chat_template)}; "
                 f"engine={v.engine}")
        return value if self.policy is None else f"{value}; policy={self.policy}"

    def _fingerprint(self) -> str:
        if self.policy is None:
            digest = _digest(_SERVER_DOMAIN, (frame_field(f) for f in self._fields()))
        else:
            digest = _digest(_GATEWAY_DOMAIN, (_length_then_tag(f) for f in self._fields()))
        return "fp_" + digest[:SHORT]

    def as_dict(self) -> dict[str, str | None]:
        """Flat: model, revision, tokenizer, chat_template, engine (and policy when set)."""
        v = self.versions
        out: dict[str, str | None] = {
            "model": self.model, "revision": v.revision, "tokenizer": v.tokenizer,
            "chat_template": v.chat_template, "engine": v.engine}
        if self.policy is not None:
            out["policy"] = self.policy
        return out

    @classmethod
    def from_header(cls, value: str) -> ResolvedVersions:
        """Read an ``x-sluice-resolved`` value back (its hashes stay shortened); raises
        ValueError when a field is missing or the value is not ``name=value; …``."""
        fields = parse_header(value)
        try:
            template = fields["chat_template"]
            served = ServedVersions(fields["revision"], fields["tokenizer"],
                                    None if template == _NONE else template, fields["engine"])
            return cls(fields["model"], served, fields.get("policy"))
        except KeyError as exc:
            raise ValueError(f"{RESOLVED_HEADER} has no {exc.args[0]!r}: {value!r}") from None


def parse_header(value: str) -> dict[str, str]:
    """``name=value; …`` as a dict, fields in order; raises ValueError for another shape."""
    out: dict[str, str] = {}
    for part in value.split(";"):
        name, eq, field_value = part.strip().partition("=")
        if not eq or not name or name in out:
            raise ValueError(f"not a {RESOLVED_HEADER} value: {value!r}")
        out[name] = field_value
    return out


# Both framings tag None apart from every string and length-prefix the bytes, so distinct
# field tuples never hash the same bytes (None vs "" vs "none", or a boundary moved).
def frame_field(value: str | None) -> bytes:
    """One field as hashed into the model server's fingerprint (and the engine's prefix-cache
    root): a tag, then for a string its length and UTF-8 bytes."""
    if value is None:
        return b"\x00"
    data = value.encode()
    return b"\x01" + len(data).to_bytes(8, "big") + data


def _length_then_tag(value: str | None) -> bytes:
    data = b"\x00" if value is None else b"\x01" + value.encode()
    return len(data).to_bytes(8, "big") + data


def _digest(domain: bytes, framed: Iterable[bytes]) -> str:
    digest = hashlib.sha256(domain)
    for part in framed:
        digest.update(part)
    return digest.hexdigest()
