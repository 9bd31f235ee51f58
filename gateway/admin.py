"""The tenant admin API, ``/admin/v1``: tenants, their keys and their usage.

Who may do what:

    operator       the key in env SLUICE_ADMIN_KEY (hashed at start; compared with
                   hmac.compare_digest): everything.
    tenant admin   a key of role ``tenant_admin`` made through this API: its own tenant
                   only — read it, its usage and its key list; create and delete its
                   ``user`` keys. Anything else is 403, another tenant included.
    anyone else    401. Where SLUICE_ADMIN_KEY is unset the admin API is off: 404.

Every write goes to the tenant store in one atomic step; this replica then reloads at once,
the others within ``admin.poll_interval_s`` (``registry.py``). Reads come from the store,
so they see every replica's writes. The two lists are paged by cursor (``paging.py``): a
page reads the store's version (one GET) and the whole store only when that version is not
the one last indexed (``Listing``), so walking 10,000 tenants costs one read of the store.

Validation (limits in ``tenant_config.py``, docs/admin.md#limits): a body is parsed strictly
(``protocol.http``: UTF-8, no lone surrogates, at most 64 levels deep) and a record is
validated whole by ``TenantEntry`` before anything is stored; what is refused is a 400
naming the field, and nothing of it is stored. A record already in the store that this
version refuses (an older version's, or one written by hand) is logged and left out of
lists and of the registry; ``GET`` of it is a 409 ``invalid_record`` naming what is wrong,
so that an operator can repair it with ``PATCH`` (which validates the merged record) or
remove it with ``DELETE``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from policies.store import StoreUnavailable
from policies.tenant_store import (
    ROLES,
    ChangedConcurrently,
    InvalidRecord,
    KeyExists,
    KeyRecord,
    NoSuchKey,
    NoSuchTenant,
    Record,
    Snapshot,
    TenantExists,
    TenantStore,
)
from protocol.http import LimitedBody, error_response, parse_json_object

from .config import TenantEntry
from .errors import (
    AuthenticationFailed,
    BadRequest,
    GatewayError,
    NotFound,
    PermissionDenied,
    ServiceUnavailable,
)
from .paging import page, page_query
from .registry import Registry, tenant_record
from .tenant_config import describe
from .tenants import bearer_key, hash_key

log = logging.getLogger("sluice.gateway.admin")

ADMIN_KEY_ENV = "SLUICE_ADMIN_KEY"
KEY_ID = re.compile(r"(key_|file-)[0-9a-f]{16}")  # fullmatch; what this API and the file make
PREFIX = "/admin/v1"
MAX_BODY_BYTES = 64 * 1024
_REPLACE_TRIES = 5  # PATCH re-reads and re-merges when another write raced it


class Conflict(GatewayError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"


class InvalidStoredRecord(Conflict):
    """A stored record this version refuses: PATCH can repair it, DELETE remove it."""

    code = "invalid_record"


@dataclass(slots=True, frozen=True)
class Principal:
    tenant: str | None  # None: the operator

    def require_operator(self, action: str) -> None:
        if self.tenant is not None:
            raise PermissionDenied(f"a tenant admin key may not {action}; that takes the "
                                   "operator key")

    def require_tenant(self, tenant_id: str) -> None:
        if self.tenant is not None and self.tenant != tenant_id:
            raise PermissionDenied(f"this key administers tenant {self.tenant!r} only")


def _invalid(exc: ValidationError) -> BadRequest:
    first, detail = describe(exc)
    return BadRequest(f"invalid tenant: {detail}", first, code="invalid_value")


def _shown(tid: str, record: Record) -> Record:
    """A stored record as the gateway applies it (defaults filled in for fields it lacks);
    InvalidStoredRecord if this version refuses it."""
    try:
        entry = TenantEntry.model_validate(record)
    except ValidationError as exc:
        _, detail = describe(exc)
        raise InvalidStoredRecord(
            f"tenant {tid!r} is stored in a form this gateway refuses ({detail}); it is left "
            "out of the registry: PATCH the named fields to repair it, or DELETE it",
            "tenant") from None
    if entry.id != tid:
        raise InvalidStoredRecord(f"the record stored as tenant {tid!r} names the id "
                                  f"{entry.id!r}; DELETE it", "tenant")
    return tenant_record(entry)


def _listed(tid: str, record: Record) -> Record | None:
    """``_shown``, or None (logged) for a record this version refuses."""
    try:
        return _shown(tid, record)
    except InvalidStoredRecord as err:
        log.warning("tenant store: %s", err.message)
        return None


def _merge(base: Record, patch: Record) -> Record:
    """JSON merge patch (RFC 7386): objects merge, null removes (the default applies)."""
    out = dict(base)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _validate(body: Record) -> Record:
    if "keys" in body:
        raise BadRequest(f"keys are made with POST {PREFIX}/tenants/{{id}}/keys, not in the "
                         "tenant record", "keys", code="invalid_value")
    try:
        return tenant_record(TenantEntry.model_validate(body))
    except ValidationError as exc:
        raise _invalid(exc) from None


async def _body(request: Request, *, required: bool = True) -> Record:
    body = LimitedBody(MAX_BODY_BYTES)
    async for chunk in request.stream():
        body.add(chunk)
    raw = body.body()
    if not raw.strip() and not required:
        return {}
    return parse_json_object(raw)


Handler = Callable[[Request, Principal], Awaitable[Response]]


class AdminApi:
    def __init__(self, env: Mapping[str, str]) -> None:
        key = env.get(ADMIN_KEY_ENV, "")
        self._operator = hashlib.sha256(key.encode()).digest() if key else None
        self._listed: Listing | None = None  # the last store version indexed for lists

    def routes(self) -> list[Route]:
        t = PREFIX + "/tenants"
        ep = self._endpoint
        return [
            Route(t, ep(self.list_tenants), methods=["GET"]),
            Route(t, ep(self.create_tenant), methods=["POST"]),
            Route(t + "/{tenant}", ep(self.get_tenant), methods=["GET"]),
            Route(t + "/{tenant}", ep(self.patch_tenant), methods=["PATCH"]),
            Route(t + "/{tenant}", ep(self.delete_tenant), methods=["DELETE"]),
            Route(t + "/{tenant}/keys", ep(self.list_keys), methods=["GET"]),
            Route(t + "/{tenant}/keys", ep(self.create_key), methods=["POST"]),
            Route(t + "/{tenant}/keys/{key}", ep(self.delete_key), methods=["DELETE"]),
            Route(t + "/{tenant}/usage", ep(self.usage), methods=["GET"]),
        ]

    def _endpoint(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                who = self._principal(request)
                if who.tenant is not None:
                    request.scope.setdefault("state", {})["tenant"] = who.tenant
                return await handler(request, who)
            except GatewayError as err:
                return error_response(err)
            except StoreUnavailable:
                return error_response(ServiceUnavailable(
                    "the tenant store is unreachable right now", retry_after_s=1.0,
                    code="store_unavailable"))
        return endpoint

    def _principal(self, request: Request) -> Principal:
        if self._operator is None:
            raise NotFound(f"the admin API is off on this gateway (set {ADMIN_KEY_ENV})")
        key = bearer_key(request.headers.get("authorization", "").encode() or None)
        # Both checks always run: the time taken does not tell which kind of key matched.
        operator = hmac.compare_digest(hashlib.sha256(key).digest(), self._operator)
        tenant = _registry(request).lookup_admin(key)
        if operator:
            return Principal(None)
        if tenant is not None:
            return Principal(tenant.id)
        raise AuthenticationFailed("incorrect admin key provided")

    async def _listing(self, store: TenantStore) -> Listing:
        """The store's current version, indexed for paging: one GET of the version per page,
        the whole store read and indexed only when the version moved since the last list."""
        listed = self._listed
        if listed is None or listed.store is not store or listed.version != await store.version():
            listed = self._listed = Listing.of(store, await store.snapshot())
        return listed

    # ---- tenants --------------------------------------------------------------------------
    async def list_tenants(self, request: Request, who: Principal) -> Response:
        query = page_query(request.query_params.multi_items(), "tenants")
        listing = await self._listing(_registry(request).store)
        ids = listing.tenant_ids if who.tenant is None else (
            [who.tenant] if who.tenant in listing.tenants else [])
        return JSONResponse(page("tenants", query, ids, _tenant_position,
                                 lambda tid: _listed(tid, listing.tenants[tid])).body())

    async def create_tenant(self, request: Request, who: Principal) -> Response:
        who.require_operator("create tenants")
        record = _validate(await _body(request))
        registry = _registry(request)
        try:
            await registry.store.create_tenant(record)
        except TenantExists:
            raise Conflict(f"tenant {record['id']!r} exists", "id") from None
        await registry.sync()
        return JSONResponse(record, status_code=201)

    async def get_tenant(self, request: Request, who: Principal) -> Response:
        tid = request.path_params["tenant"]
        who.require_tenant(tid)
        return JSONResponse(_shown(tid, await _existing(_registry(request), tid)))

    async def patch_tenant(self, request: Request, who: Principal) -> Response:
        tid = request.path_params["tenant"]
        who.require_operator("change tenants or their quotas")
        patch = await _body(request)
        if patch.get("id", tid) != tid:
            raise BadRequest("a tenant's id cannot change", "id", code="invalid_value")
        registry = _registry(request)
        previous: Record | None = None
        for _ in range(_REPLACE_TRIES):
            current = await _existing(registry, tid)
            if current == previous:  # the same record, yet the compare failed: hand-written
                raise InvalidStoredRecord(f"tenant {tid!r} is stored in a form this gateway "
                                          "does not write; DELETE it and create it again",
                                          "tenant")
            record = _validate(_merge(current, patch))
            try:
                await registry.store.replace_tenant(record, current)
            except ChangedConcurrently:
                previous = current
                continue
            except NoSuchTenant:
                raise NotFound(f"no tenant {tid!r}", "tenant") from None
            await registry.sync()
            return JSONResponse(record)
        raise Conflict(f"tenant {tid!r} kept changing while being patched; try again")

    async def delete_tenant(self, request: Request, who: Principal) -> Response:
        tid = request.path_params["tenant"]
        who.require_operator("delete tenants")
        registry = _registry(request)
        try:
            await registry.store.delete_tenant(tid)
        except NoSuchTenant:
            raise NotFound(f"no tenant {tid!r}", "tenant") from None
        await registry.sync()
        return JSONResponse({"id": tid, "object": "tenant", "deleted": True})

    # ---- keys -----------------------------------------------------------------------------
    async def list_keys(self, request: Request, who: Principal) -> Response:
        tid = request.path_params["tenant"]
        who.require_tenant(tid)
        query = page_query(request.query_params.multi_items(), "keys")
        listing = await self._listing(_registry(request).store)
        if tid not in listing.tenants:
            raise NotFound(f"no tenant {tid!r}", "tenant")
        return JSONResponse(page("keys", query, listing.keys.get(tid, []), _key_position,
                                 _key_shown).body())

    async def create_key(self, request: Request, who: Principal) -> Response:
        tid = request.path_params["tenant"]
        who.require_tenant(tid)
        body = await _body(request, required=False)
        extra = sorted(set(body) - {"role"})
        if extra:
            raise BadRequest(f"unknown field {extra[0]!r}; a key takes only 'role'", extra[0],
                             code="unknown_parameter")
        role = body.get("role", "user")
        if role not in ROLES:
            raise BadRequest(f"role must be one of {list(ROLES)}", "role", code="invalid_value")
        if role != "user" and who.tenant is not None:
            raise PermissionDenied("a tenant admin key may create user keys only", "role")
        key = "sk-" + secrets.token_urlsafe(32)
        record = KeyRecord(id="key_" + secrets.token_hex(8), tenant=tid, role=role,
                           digest=hash_key(key), created=int(time.time()))
        registry = _registry(request)
        try:
            await registry.store.add_key(record)
        except NoSuchTenant:
            raise NotFound(f"no tenant {tid!r}", "tenant") from None
        except KeyExists:  # 64 random bits collided: astronomically rare, safe to retry
            raise Conflict("key id collision; try again") from None
        await registry.sync()
        return JSONResponse({"id": record.id, "key": key, "role": role, "tenant": tid,
                             "created": record.created}, status_code=201,
                            headers={"cache-control": "no-store"})

    async def delete_key(self, request: Request, who: Principal) -> Response:
        tid, kid = request.path_params["tenant"], request.path_params["key"]
        who.require_tenant(tid)
        registry = _registry(request)
        found = (await registry.store.snapshot()).keys.get(kid)
        if found is None or found.tenant != tid:
            raise NotFound(f"tenant {tid!r} has no key {kid!r}", "key")
        if found.role != "user" and who.tenant is not None:
            raise PermissionDenied("a tenant admin key may delete user keys only", "key")
        try:
            await registry.store.delete_key(tid, kid)
        except NoSuchKey:
            raise NotFound(f"tenant {tid!r} has no key {kid!r}", "key") from None
        await registry.sync()
        return JSONResponse({"id": kid, "object": "key", "deleted": True})

    # ---- usage ----------------------------------------------------------------------------
    async def usage(self, request: Request, who: Principal) -> Response:
        tid = request.path_params["tenant"]
        who.require_tenant(tid)
        await _existing(_registry(request), tid)
        store: Any = request.app.state.gateway.admission.store
        return JSONResponse({"tenant": tid, **await store.usage(tid)})


def _registry(request: Request) -> Registry:
    registry: Registry = request.app.state.gateway.registry
    return registry


async def _existing(registry: Registry, tid: str) -> Record:
    """The stored record (maybe one this version refuses); 404, or 409 if unreadable."""
    try:
        record = await registry.store.get_tenant(tid)
    except InvalidRecord as exc:
        raise InvalidStoredRecord(f"{exc}; DELETE it", "tenant") from None
    if record is None:
        raise NotFound(f"no tenant {tid!r}", "tenant")
    return record


@dataclass(slots=True, frozen=True)
class Listing:
    """One version of the tenant store, sorted for paging; built whole, never changed.

    A version names one content of the store: every write bumps it, and a store that lost
    its data starts again from Redis TIME in µs (``tenants_lib.lua``), never at an old
    number, so a listing is reused for as long as the store's version is its own.
    """

    store: TenantStore
    version: int
    tenants: dict[str, Record]  # as stored; validated page by page (``_listed``)
    tenant_ids: list[str]  # sorted
    keys: dict[str, list[KeyRecord]]  # by tenant, sorted by (created, id)

    @classmethod
    def of(cls, store: TenantStore, snap: Snapshot) -> Listing:
        for rid in snap.unreadable:
            log.warning("tenant store: record %r cannot be read; left out", rid)
        keys: dict[str, list[KeyRecord]] = {}
        for key in snap.keys.values():
            if _key_id_ok(key):
                keys.setdefault(key.tenant, []).append(key)
        for listed in keys.values():
            listed.sort(key=_key_position)
        return cls(store, snap.version, snap.tenants, sorted(snap.tenants), keys)


def _tenant_position(tid: str) -> tuple[str]:
    return (tid,)


def _key_position(key: KeyRecord) -> tuple[int, str]:
    return (key.created, key.id)


def _key_shown(key: KeyRecord) -> Record:
    return {"id": key.id, "role": key.role, "created": key.created}


def _key_id_ok(key: KeyRecord) -> bool:
    if KEY_ID.fullmatch(key.id):
        return True
    log.warning("tenant store: key %r of tenant %r has an id this API never makes; left out "
                "of the list", key.id, key.tenant)
    return False


def admin_routes(env: Mapping[str, str] | None = None) -> list[Route]:
    """The /admin/v1 routes; the operator key is read from ``env`` (os.environ) now."""
    return AdminApi(os.environ if env is None else env).routes()
