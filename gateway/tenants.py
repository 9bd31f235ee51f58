"""Tenants and their keys.

A key is never stored: the tenants file holds ``sha256:<hex>`` of each key. Authentication
hashes the presented key and looks the digest up in a dict (``KeyRing``, which says why
that is safe): O(1), however many keys there are.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from policies.degrade import DegradeRules
from policies.quotas import Quotas

from .config import Caps, PriorityRange, TenantEntry, TenantsFile
from .errors import AuthenticationFailed

_BEARER = b"bearer "
MAX_KEY_BYTES = 512


def _rules(entry: TenantEntry) -> DegradeRules | None:
    d = entry.degrade
    if d is None:
        return None
    fb = d.fallback
    return DegradeRules(d.batch_priority, d.clamp_at, d.clamp_max_tokens, d.shed_batch_at,
                        fb.model if fb else None, fb.at if fb else 0.9)


def hash_key(key: str) -> str:
    """The form a key takes in tenants.yaml."""
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(slots=True, frozen=True)
class Tenant:
    id: str
    name: str
    models: frozenset[str]  # "*" allows every model
    priority: PriorityRange
    caps: Caps
    quotas: Quotas
    max_queued: int | None
    fail_mode: str  # closed | open
    weight: float  # fair share of dispatches within a priority class
    policy_version: str  # `<id>@<12 hex>` of everything but the keys: goes into the stamp
    degrade: DegradeRules | None = None

    def may_use(self, model: str) -> bool:
        return "*" in self.models or model in self.models

    @classmethod
    def from_entry(cls, entry: TenantEntry) -> Tenant:
        policy = entry.model_dump(mode="json", exclude={"keys"})
        digest = hashlib.sha256(json.dumps(policy, sort_keys=True).encode()).hexdigest()
        q = entry.quotas
        return cls(id=entry.id, name=entry.name or entry.id, models=frozenset(entry.models),
                   priority=entry.priority, caps=entry.caps,
                   quotas=Quotas(tokens_per_minute=q.tokens_per_minute,
                                 requests_per_minute=q.requests_per_minute,
                                 tokens_per_day=q.tokens_per_day,
                                 tokens_per_month=q.tokens_per_month,
                                 max_concurrency=q.max_concurrency),
                   max_queued=q.max_queued, fail_mode=entry.fail_mode, weight=entry.weight,
                   policy_version=f"{entry.id}@{digest[:12]}", degrade=_rules(entry))


class KeyRing:
    """Maps a bearer key to its tenant: one dict lookup by the key's SHA-256 digest, however
    many keys there are.

    Indexing by the digest is safe although a dict lookup is not constant-time: what the
    timing could reveal is how the presented key's digest compares with stored digests,
    and a caller cannot choose a digest (that takes a SHA-256 preimage), so learning a
    digest's bytes brings no key closer. The keys are high-entropy secrets that the admin
    API generates, so a stored digest cannot be reversed by guessing either.
    """

    def __init__(self, tenants: TenantsFile) -> None:
        self.tenants: dict[str, Tenant] = {}
        self._by_digest: dict[bytes, Tenant] = {}
        for entry in tenants.tenants:
            tenant = Tenant.from_entry(entry)
            self.tenants[tenant.id] = tenant
            for key in entry.keys:
                self._by_digest[bytes.fromhex(key.removeprefix("sha256:"))] = tenant

    def __len__(self) -> int:
        """How many keys the ring holds."""
        return len(self._by_digest)

    def lookup(self, key: bytes) -> Tenant | None:
        """The tenant owning ``key``, or None."""
        return self._by_digest.get(hashlib.sha256(key).digest())

    @classmethod
    def from_records(cls, tenants: Mapping[str, Tenant],
                     keys: Iterable[tuple[str, str]]) -> KeyRing:
        """A ring over built tenants and ``(sha256:<hex> digest, tenant id)`` pairs; a key
        whose tenant is not in ``tenants`` is left out."""
        ring = cls(TenantsFile(tenants=[]))
        ring.tenants = dict(tenants)
        for digest, tenant_id in keys:
            owner = ring.tenants.get(tenant_id)
            if owner is not None:
                ring._by_digest[bytes.fromhex(digest.removeprefix("sha256:"))] = owner
        return ring

    def authenticate(self, authorization: bytes | None) -> Tenant:
        """The tenant for an ``Authorization: Bearer KEY`` header value, or 401."""
        tenant = self.lookup(bearer_key(authorization))
        if tenant is None:
            raise AuthenticationFailed("incorrect API key provided")
        return tenant


def bearer_key(authorization: bytes | None) -> bytes:
    """The key of an ``Authorization: Bearer KEY`` header value, or 401."""
    if not authorization:
        raise AuthenticationFailed("missing Authorization header; send "
                                   "'Authorization: Bearer YOUR_KEY'")
    if len(authorization) > MAX_KEY_BYTES + len(_BEARER) \
            or authorization[: len(_BEARER)].lower() != _BEARER:
        raise AuthenticationFailed("malformed Authorization header; send "
                                   "'Authorization: Bearer YOUR_KEY'")
    key = authorization[len(_BEARER):].strip()
    if not key:
        raise AuthenticationFailed("empty API key in the Authorization header")
    return key
