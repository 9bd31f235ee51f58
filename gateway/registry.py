"""The live tenant registry: the key ring, kept in step with the tenant store.

``Registry`` answers exactly what ``KeyRing`` answers (``authenticate``, ``lookup``,
``tenants``), from the records every replica shares through the tenant store
(``policies.tenant_store``: Redis, or in memory for one process). Each replica reads the
store's version every ``admin.poll_interval_s`` (one GET) and reloads when it changed; a
replica that wrote a change reloads at once. A reload reads every record but parses and
validates only those whose text changed (``Snapshot.parse``, ``view_of``): after one change
at 10,000 tenants it validates one tenant, not 10,000 (docs/admin.md, "Many tenants and
keys"). Until the store first answers, and whenever it is down, the registry keeps
serving what it last loaded (at start: the tenants file) and logs it.

Seeding: at start (and when the store turns out empty: a Redis that lost its data), the
tenants file's tenants and keys are written to the store where absent. A record already in
the store wins over the file, so a tenant created or changed through the admin API keeps
the API's version; a tenant or key deleted through the API stays deleted (the store
remembers the deletion). File keys get stable ids (``file-…``) so every replica seeds the
same record.

Two rings: ``user`` keys authenticate on /v1; ``tenant_admin`` keys only on /admin/v1
(``lookup_admin``). Both are ``KeyRing``s: one hash of the presented key and one dict
lookup, however many keys there are.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import ValidationError

from policies.store import StoreUnavailable
from policies.tenant_store import (
    KeyRecord,
    MemoryTenantStore,
    Record,
    RedisTenantStore,
    Snapshot,
    TenantStore,
)

from .config import GatewayConfig, TenantEntry, TenantsFile
from .tenant_config import describe
from .tenants import KeyRing, Tenant

log = logging.getLogger("sluice.gateway.registry")

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")  # fullmatch ("$" would take a trailing newline)
_LOG_EVERY_S = 10.0


def file_key_id(digest: str) -> str:
    """A tenants-file key's id: the same on every replica, and not the digest itself."""
    return "file-" + hashlib.sha256(b"sluice/key-id\0" + digest.encode()).hexdigest()[:16]


def tenant_record(entry: TenantEntry) -> Record:
    """What the store keeps of a tenant: its policy, without keys."""
    return entry.model_dump(mode="json", exclude={"keys"})


def seed_records(tenants: TenantsFile, now: int) -> tuple[list[Record], list[KeyRecord]]:
    records = [tenant_record(t) for t in tenants.tenants]
    keys = [KeyRecord(id=file_key_id(k), tenant=t.id, role="user", digest=k, created=now)
            for t in tenants.tenants for k in t.keys]
    return records, keys


def build_tenant_store(config: GatewayConfig) -> TenantStore:
    if config.store.url is None:
        return MemoryTenantStore()
    return RedisTenantStore(config.store.url, timeout_s=config.store.timeout_s,
                            cluster=config.store.cluster)


@dataclass(slots=True, frozen=True)
class View:
    """One loaded version of the store: replaced whole, never changed in place."""

    version: int
    users: KeyRing
    admins: KeyRing
    # the tenant records these rings were built from (a snapshot's, or the file's)
    records: Mapping[str, Record] = field(default_factory=dict)


def view_of(snapshot: Snapshot, previous: View | None = None) -> View:
    """Build the rings; a record that does not validate is left out and logged (the other
    tenants are served: one bad record never stops a reload).

    A tenant whose record equals the one ``previous`` was built from keeps its ``Tenant``
    (a pure function of the record): a reload after one change validates one tenant, not
    10,000, and the first load after seeding reuses the file's. The compare is cheap: the
    store hands back the very objects of its last snapshot for unchanged texts. Key rings
    are rebuilt whole: a dict of digests, the cheap part."""
    for rid in snapshot.unreadable:
        log.error("tenant store: record %r cannot be read; left out", rid)
    old_records = previous.records if previous is not None else {}
    old_tenants = previous.users.tenants if previous is not None else {}
    tenants: dict[str, Tenant] = {}
    for tid, record in snapshot.tenants.items():
        if old_records.get(tid) == record:
            if tid in old_tenants:
                tenants[tid] = old_tenants[tid]
            continue  # the same record, refused (and logged) at its last load
        try:
            entry = TenantEntry.model_validate(record)
        except ValidationError as exc:
            log.error("tenant store: tenant %a is invalid, left out: %s", tid,
                      describe(exc)[1])
            continue
        if entry.id == tid:
            tenants[tid] = Tenant.from_entry(entry)
    users: list[tuple[str, str]] = []
    admins: list[tuple[str, str]] = []
    for key in snapshot.keys.values():
        if _DIGEST.fullmatch(key.digest):
            (users if key.role == "user" else admins).append((key.digest, key.tenant))
    return View(snapshot.version, KeyRing.from_records(tenants, users),
                KeyRing.from_records(tenants, admins), snapshot.tenants)


class Registry:
    """Tenants and keys of every replica; a drop-in for ``KeyRing``."""

    def __init__(self, config: GatewayConfig, tenants: TenantsFile,
                 store: TenantStore | None = None) -> None:
        self.store = store or build_tenant_store(config)
        self.poll_interval_s = config.admin.poll_interval_s
        self._seed = seed_records(tenants, int(time.time()))
        file_ring = KeyRing(tenants)
        # Version 0 is never a written store's: the first successful sync always loads.
        self._view = View(0, file_ring, KeyRing.from_records(file_ring.tenants, []),
                          {str(r["id"]): r for r in self._seed[0]})
        self._seeded = False
        self._lock = asyncio.Lock()
        self._poller: asyncio.Task[None] | None = None
        self._down = False
        self._last_log = 0.0

    # ---- the KeyRing interface ------------------------------------------------------------
    @property
    def tenants(self) -> dict[str, Tenant]:
        return self._view.users.tenants

    @property
    def version(self) -> int:
        """The store version loaded (0: the tenants file, the store not read yet)."""
        return self._view.version

    def lookup(self, key: bytes) -> Tenant | None:
        """The tenant owning user key ``key``."""
        return self._view.users.lookup(key)

    def authenticate(self, authorization: bytes | None) -> Tenant:
        """The tenant for an ``Authorization: Bearer KEY`` header with a user key, or 401."""
        return self._view.users.authenticate(authorization)

    def lookup_admin(self, key: bytes) -> Tenant | None:
        """The tenant that tenant-admin key ``key`` administers."""
        return self._view.admins.lookup(key)

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Seed and load once (serving the file if the store is down), then poll."""
        if not await self.sync():
            log.warning("tenant store unreachable at start: serving the tenants file until "
                        "it answers")
        self._poller = asyncio.ensure_future(self._poll())

    async def aclose(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await self.store.close()

    async def sync(self) -> bool:
        """Seed if needed and reload if the version moved; False while the store is down."""
        async with self._lock:
            try:
                version = await self.store.version()
                if version == 0 or not self._seeded:
                    if self._seeded:
                        log.warning("tenant store is empty (did Redis lose its data?): "
                                    "seeding it from the tenants file again")
                    await self.store.seed(*self._seed)
                    self._seeded = True
                    version = -1  # reload whatever the store holds now
                if version != self._view.version:
                    self._view = view_of(await self.store.snapshot(), self._view)
                    log.debug("tenant registry at version %d", self._view.version)
            except StoreUnavailable as exc:
                self._store_down(exc)
                return False
        if self._down:
            self._down = False
            log.warning("tenant store reachable again (version %d)", self._view.version)
        return True

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self.sync()
            except Exception:  # a bug must not end the polling: keep the last records
                log.exception("tenant registry: reload failed")

    def _store_down(self, exc: Exception) -> None:
        now = time.monotonic()
        if not self._down or now - self._last_log >= _LOG_EVERY_S:
            self._last_log = now
            log.warning("tenant store unreachable (%s): serving the tenants and keys of "
                        "version %d", exc, self._view.version)
        self._down = True
