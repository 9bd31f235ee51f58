"""The tenant store: tenant and key records shared by gateway replicas, with a version.

    StoreError                  (policies.store)
    ├── StoreUnavailable        the store cannot be reached or did not answer in time
    ├── TenantExists            create of an id that is taken
    ├── NoSuchTenant            a change to a tenant that is not there
    ├── KeyExists               add_key() of a key id that is taken
    ├── NoSuchKey               delete of a key the tenant does not have
    ├── ChangedConcurrently     replace() lost a race: the record changed since it was read
    └── InvalidRecord           get_tenant() of a stored record that is not a JSON object

Invariants both implementations keep (tests/policies/test_tenant_store.py checks them):

- Records are canonical JSON (sorted keys, no spaces): a tenant record is whatever the
  caller validated (the gateway's ``TenantEntry`` without keys); a key record holds the
  key's SHA-256 digest, never the key.
- Every write that changes something bumps one global version in the same atomic step,
  so one cheap ``version()`` read tells a replica whether to reload; ``snapshot()`` reads
  the version and every record atomically. A version is never 0 once the store has been
  written (or seeded): 0 means an empty store (a Redis that lost its data).
- Deleting a tenant deletes its keys. What the API deletes is remembered, so ``seed()``
  (the tenants file, at every start) never brings it back; it writes only absent records.
- A record that cannot be read (not a JSON object, nested past the parser, a key record
  without its string fields), written by hand or by an older version, never fails a read or
  a write: ``snapshot()`` lists it in ``unreadable``, ``get_tenant()`` raises
  ``InvalidRecord``, a tenant's delete leaves such a key record alone, and no write stops
  halfway (each is one Lua script, none of which can fail once it has written). Writes
  refuse non-finite numbers (``canonical``) before anything is stored.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar, cast

from redis.commands.core import AsyncScript

from policies.redis_store import Client, connect, guarded, lua_source, permits, ping_all
from policies.store import StoreError

Role = Literal["user", "tenant_admin"]
ROLES: tuple[Role, ...] = ("user", "tenant_admin")
Record = dict[str, Any]


class TenantExists(StoreError):
    """A tenant with this id exists."""


class NoSuchTenant(StoreError):
    """No tenant with this id."""


class KeyExists(StoreError):
    """A key with this id exists."""


class NoSuchKey(StoreError):
    """The tenant has no key with this id."""


class ChangedConcurrently(StoreError):
    """The tenant record changed between the caller's read and its replace()."""


class InvalidRecord(StoreError):
    """The stored record is not a JSON object (written by hand, or by an older version)."""


def canonical(record: Record, *, strict: bool = True) -> str:
    """A record's stored form. ``strict`` (every write) refuses NaN and Infinity with a
    ValueError, before anything is stored; a record read back compares with strict off."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"), allow_nan=not strict)


def parse_record(text: str | bytes) -> Record:
    """A stored record, which must be a JSON object; ValueError otherwise (never a
    RecursionError, whatever the nesting)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if not isinstance(value, dict):
        # ValueError, as for text that is not JSON: callers catch one error for both
        raise ValueError(f"a {type(value).__name__}, not a JSON object")  # noqa: TRY004
    return value


def key_tenant(text: str) -> str | None:
    """The tenant a stored key record names; None if it names none (tenants_lib.lua's
    ``key_tenant``, so that both stores delete the same key records with a tenant)."""
    try:
        tenant = parse_record(text).get("tenant")
    except ValueError:
        return None
    return tenant if isinstance(tenant, str) else None


@dataclass(slots=True, frozen=True)
class KeyRecord:
    id: str
    tenant: str
    role: Role
    digest: str  # "sha256:<hex>" of the key
    created: int  # epoch seconds (the writer's clock; informational)

    def to_json(self) -> str:
        # A dict literal, not dataclasses.asdict (a deep copy, which was half of the time
        # seeding 100,000 keys took: gateway/bench_tenants.py).
        return canonical({"created": self.created, "digest": self.digest, "id": self.id,
                          "role": self.role, "tenant": self.tenant})

    @classmethod
    def from_json(cls, text: str | bytes) -> KeyRecord:
        """A stored key record; ValueError unless its fields are ASCII strings (``created``
        an integer) and its role is known."""
        d = parse_record(text)
        fields = [d.get(k) for k in ("id", "tenant", "role", "digest")]
        if not all(isinstance(v, str) and v.isascii() for v in fields):
            raise ValueError("a key record's id, tenant, role and digest are ASCII strings")
        kid, tenant, role, digest = cast(list[str], fields)
        created = d.get("created")
        if type(created) is not int:
            raise ValueError("a key record's created is an integer")
        if role not in ROLES:
            raise ValueError(f"unknown key role {role!r}")
        # one string per tenant id and per role, not one per key (100,000 keys: ~11 MB)
        return cls(id=kid, tenant=sys.intern(tenant), role=ROLES[ROLES.index(role)],
                   digest=digest, created=created)


@dataclass(slots=True, frozen=True)
class Snapshot:
    version: int
    tenants: dict[str, Record]
    keys: dict[str, KeyRecord]  # by key id
    unreadable: tuple[str, ...] = ()  # ids of records that cannot be read (skipped)
    # The stored texts, by id, so that the next snapshot reuses what this one parsed of
    # every record whose text did not change (``parse``'s ``previous``).
    tenant_texts: Mapping[str, str | bytes] = field(default_factory=dict, compare=False,
                                                    repr=False)
    key_texts: Mapping[str, str | bytes] = field(default_factory=dict, compare=False,
                                                 repr=False)

    @classmethod
    def parse(cls, version: int, tenants: Mapping[str, str | bytes],
              keys: Mapping[str, str | bytes], previous: Snapshot | None = None) -> Snapshot:
        """Parse the stored texts, taking from ``previous`` every record whose text is the
        same there: a reload after one change parses one record, not 110,000, and the
        records it did not parse are the very objects of ``previous`` (so ``view_of``'s
        compare of records is cheap). The texts are copied: the caller may change its
        mappings later."""
        bad: list[str] = []
        tenant_texts, key_texts = dict(tenants), dict(keys)
        records = _parse_all(tenant_texts, previous.tenant_texts if previous else {},
                             previous.tenants if previous else {}, parse_record, bad)
        key_records = _parse_all(key_texts, previous.key_texts if previous else {},
                                 previous.keys if previous else {}, KeyRecord.from_json, bad)
        return cls(version, records, key_records, tuple(bad), tenant_texts, key_texts)


T = TypeVar("T")


def _parse_all(texts: Mapping[str, str | bytes], old_texts: Mapping[str, str | bytes],
               old: dict[str, T], parse: Callable[[str | bytes], T], bad: list[str]
               ) -> dict[str, T]:
    """``parse`` of every text (ValueError: its id goes to ``bad``), reusing ``old``'s
    record where the text is ``old_texts``'s."""
    if texts == old_texts:  # nothing changed: one compare in C, no parse
        bad.extend(i for i in texts if i not in old)
        return old
    out: dict[str, T] = {}
    for rid, text in texts.items():
        if old_texts.get(rid) == text and rid in old:
            out[rid] = old[rid]
            continue
        try:
            out[rid] = parse(text)
        except ValueError:  # UnicodeDecodeError included
            bad.append(rid)
    return out


class TenantStore(Protocol):
    async def version(self) -> int:
        """The change counter (one cheap read); 0 for a store never written."""
        ...

    async def snapshot(self) -> Snapshot:
        """Version and every record, read atomically. A record whose stored text did not
        change since this store's last snapshot is reused from it, not parsed again."""
        ...

    async def get_tenant(self, tenant_id: str) -> Record | None:
        """The stored record (None if absent); InvalidRecord if it cannot be read."""
        ...

    async def create_tenant(self, record: Record) -> int:
        """Add ``record`` (its ``id`` must be free, else TenantExists); the new version."""
        ...

    async def replace_tenant(self, record: Record, expected: Record) -> int:
        """Write ``record`` if the stored one still equals ``expected`` (else
        ChangedConcurrently; NoSuchTenant if gone); the new version."""
        ...

    async def delete_tenant(self, tenant_id: str) -> int:
        """Remove the tenant and its keys (NoSuchTenant if absent); the new version."""
        ...

    async def add_key(self, key: KeyRecord) -> int:
        """Add a key to an existing tenant (NoSuchTenant); the new version."""
        ...

    async def delete_key(self, tenant_id: str, key_id: str) -> int:
        """Remove the tenant's key (NoSuchKey if it has none by that id); the new version."""
        ...

    async def seed(self, tenants: Sequence[Record], keys: Sequence[KeyRecord]) -> int:
        """Write the records that are absent and were never deleted; how many were."""
        ...

    async def ping(self) -> None: ...

    async def close(self) -> None: ...


class MemoryTenantStore:
    """The tenant store of one process. No method awaits between its reads and writes, so
    each is one atomic step on the event loop, as a Lua script is in Redis."""

    def __init__(self) -> None:
        self._version = 0
        self._records: dict[str, str] = {}
        self._keys: dict[str, str] = {}
        self._deleted: set[str] = set()
        self._last: Snapshot | None = None  # reused by the next snapshot()

    def _bump(self) -> int:
        self._version += 1
        return self._version

    async def version(self) -> int:
        return self._version

    async def snapshot(self) -> Snapshot:
        self._last = Snapshot.parse(self._version, self._records, self._keys, self._last)
        return self._last

    async def get_tenant(self, tenant_id: str) -> Record | None:
        text = self._records.get(tenant_id)
        return None if text is None else _readable(tenant_id, text)

    async def create_tenant(self, record: Record) -> int:
        tid = str(record["id"])
        if tid in self._records:
            raise TenantExists(tid)
        self._records[tid] = canonical(record)
        self._deleted.discard("t:" + tid)
        return self._bump()

    async def replace_tenant(self, record: Record, expected: Record) -> int:
        tid = str(record["id"])
        current = self._records.get(tid)
        if current is None:
            raise NoSuchTenant(tid)
        new = canonical(record)
        if current != canonical(expected, strict=False):
            raise ChangedConcurrently(tid)
        if new == current:
            return self._version
        self._records[tid] = new
        return self._bump()

    async def delete_tenant(self, tenant_id: str) -> int:
        if self._records.pop(tenant_id, None) is None:
            raise NoSuchTenant(tenant_id)
        self._deleted.add("t:" + tenant_id)
        for kid, text in list(self._keys.items()):
            if key_tenant(text) == tenant_id:
                del self._keys[kid]
                self._deleted.add("k:" + kid)
        return self._bump()

    async def add_key(self, key: KeyRecord) -> int:
        if key.tenant not in self._records:
            raise NoSuchTenant(key.tenant)
        if key.id in self._keys:
            raise KeyExists(key.id)
        self._keys[key.id] = key.to_json()
        return self._bump()

    async def delete_key(self, tenant_id: str, key_id: str) -> int:
        text = self._keys.get(key_id)
        if text is None or key_tenant(text) != tenant_id:
            raise NoSuchKey(key_id)
        del self._keys[key_id]
        self._deleted.add("k:" + key_id)
        return self._bump()

    async def seed(self, tenants: Sequence[Record], keys: Sequence[KeyRecord]) -> int:
        written = 0
        texts = [canonical(r) for r in tenants]  # refuses a bad record before any write
        for record, text in zip(tenants, texts, strict=True):
            tid = str(record["id"])
            if "t:" + tid not in self._deleted and tid not in self._records:
                self._records[tid] = text
                written += 1
        for key in keys:
            if key.tenant in self._records and "k:" + key.id not in self._deleted \
                    and key.id not in self._keys:
                self._keys[key.id] = key.to_json()
                written += 1
        if written or self._version == 0:
            self._bump()
        return written

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None


SEED_BATCH = 1_000  # records per seeding script
# A snapshot's deadline and read timeout: it reads every record (100,000 keys: 200,000 reply
# elements, which redis-py without hiredis parses in seconds on a slow core), off the
# request path (the poller, an admin list): the request path's timeout does not fit it.
BULK_DEADLINE_S = 10.0
_SCRIPTS = ("tenant_create", "tenant_replace", "tenant_delete", "key_add", "key_delete",
            "tenants_seed")


class RedisTenantStore:
    """The tenant store over Redis (layout: ``policies/lua/tenants_lib.lua``); every write is
    one Lua script, every Redis failure or overrun ``StoreUnavailable``."""

    def __init__(self, url: str, *, timeout_s: float = 0.25, key_prefix: str = "sluice",
                 max_connections: int = 8, cluster: bool = False) -> None:
        if "{" in key_prefix or "}" in key_prefix:
            raise ValueError("key_prefix must not contain braces (they set the hash tag)")
        # The quota store's connection settings and whole-call deadline. On a cluster the
        # whole registry is one slot (one master): every script and the snapshot's MULTI
        # touch only {registry:tenants}.
        self._deadline_s = 2 * timeout_s
        self._redis: Client = connect(url, timeout_s, max_connections, cluster=cluster)
        self._permits = permits(self._redis, max_connections)
        tag = f"{key_prefix}:{{registry:tenants}}"
        self.keys = [f"{tag}:{k}" for k in ("version", "records", "keys", "deleted")]
        lib = lua_source("tenants_lib")
        self._scripts: dict[str, AsyncScript] = {
            name: self._redis.register_script(lib + "\n" + lua_source(name))
            for name in _SCRIPTS}
        # snapshot()'s own client: redis-py bounds a whole reply's parse by the socket
        # timeout, and 100,000 keys parse for longer than a request-path timeout
        self._bulk: Client = connect(url, BULK_DEADLINE_S, 1, cluster=cluster)
        self._bulk_permits = permits(self._bulk, 1)
        self._last: Snapshot | None = None  # reused by the next snapshot()

    async def version(self) -> int:
        raw = await self._guard(self._redis.get(self.keys[0]))
        return int(raw or 0)

    async def snapshot(self) -> Snapshot:
        """On the bulk client, within ``BULK_DEADLINE_S``; records whose text did not change
        since the last snapshot are reused, not parsed again."""
        async def read() -> list[Any]:
            async with self._bulk.pipeline(transaction=True) as pipe:
                pipe.get(self.keys[0])
                pipe.hgetall(self.keys[1])
                pipe.hgetall(self.keys[2])
                return await pipe.execute()

        version, records, keys = await guarded(self._bulk, BULK_DEADLINE_S, read(),
                                               self._bulk_permits)
        # a field name written by hand may not be UTF-8: its record is then refused by id
        self._last = Snapshot.parse(
            int(version or 0), {k.decode(errors="replace"): v for k, v in records.items()},
            {k.decode(errors="replace"): v for k, v in keys.items()}, self._last)
        return self._last

    async def get_tenant(self, tenant_id: str) -> Record | None:
        raw = await self._guard(self._redis.hget(self.keys[1], tenant_id))
        return None if raw is None else _readable(tenant_id, raw)

    async def create_tenant(self, record: Record) -> int:
        tid = str(record["id"])
        version = await self._run("tenant_create", tid, canonical(record))
        if version == 0:
            raise TenantExists(tid)
        return version

    async def replace_tenant(self, record: Record, expected: Record) -> int:
        tid = str(record["id"])
        new = canonical(record)
        version = await self._run("tenant_replace", tid, canonical(expected, strict=False), new)
        if version == -1:
            raise NoSuchTenant(tid)
        if version == -2:
            raise ChangedConcurrently(tid)
        return version

    async def delete_tenant(self, tenant_id: str) -> int:
        version = await self._run("tenant_delete", tenant_id)
        if version == 0:
            raise NoSuchTenant(tenant_id)
        return version

    async def add_key(self, key: KeyRecord) -> int:
        version = await self._run("key_add", key.tenant, key.id, key.to_json())
        if version == -1:
            raise NoSuchTenant(key.tenant)
        if version == 0:
            raise KeyExists(key.id)
        return version

    async def delete_key(self, tenant_id: str, key_id: str) -> int:
        version = await self._run("key_delete", tenant_id, key_id)
        if version == 0:
            raise NoSuchKey(key_id)
        return version

    async def seed(self, tenants: Sequence[Record], keys: Sequence[KeyRecord]) -> int:
        """In batches of ``SEED_BATCH`` records, one script and one argument each
        (``tenants_seed.lua``): every batch stays within the deadline and holds Redis for
        milliseconds, at 100,000 keys too. Each batch writes only absent records, so the
        batches need not be one atomic step: a seed cut short by an outage is finished by
        the next (the registry seeds until one succeeds). Tenants go first, so key batches
        find them."""
        tenant_fields = [(str(r["id"]), canonical(r)) for r in tenants]  # refuses a bad
        key_fields = [(k.id, k.tenant, k.to_json()) for k in keys]  # record before any write
        batches = [("t", _lines(tenant_fields[i:i + SEED_BATCH]))
                   for i in range(0, len(tenant_fields), SEED_BATCH)]
        batches += [("k", _lines(key_fields[i:i + SEED_BATCH]))
                    for i in range(0, len(key_fields), SEED_BATCH)]
        written = 0
        for kind, text in batches or [("t", "")]:  # seeding nothing still marks the store
            written += await self._run("tenants_seed", kind, text)
        return written

    async def ping(self) -> None:
        await self._guard(ping_all(self._redis))

    async def close(self) -> None:
        try:
            await self._redis.aclose()
        finally:
            await self._bulk.aclose()

    async def _run(self, script: str, *args: str) -> int:
        return int(await self._guard(self._scripts[script](keys=self.keys, args=args)))

    async def _guard(self, call: Any) -> Any:
        return await guarded(self._redis, self._deadline_s, call, self._permits)


def _lines(rows: Sequence[tuple[str, ...]]) -> str:
    """Fields one a line (``tenants_seed.lua``); ValueError for a field that is empty or
    holds a newline (validated ids and canonical JSON never do)."""
    fields = [f for row in rows for f in row]
    if any(not f or "\n" in f for f in fields):
        raise ValueError("a seeded id or record is empty or holds a newline")
    return "\n".join(fields)


def _readable(tenant_id: str, text: str | bytes) -> Record:
    try:
        return parse_record(text)
    except ValueError as exc:
        raise InvalidRecord(f"tenant {tenant_id!r}: the stored record cannot be read ({exc})") \
            from None
