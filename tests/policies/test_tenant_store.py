"""The TenantStore contract, one suite over MemoryTenantStore and RedisTenantStore, and
what only Redis can show (a second pool, its clock, its outages, its key layout)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis
from redis.crc import key_slot

from policies.store import StoreUnavailable
from policies.tenant_store import (
    ChangedConcurrently,
    InvalidRecord,
    KeyExists,
    KeyRecord,
    MemoryTenantStore,
    NoSuchKey,
    NoSuchTenant,
    RedisTenantStore,
    TenantExists,
    TenantStore,
)
from tests.policies.conftest import RedisServer

ALPHA = {"id": "alpha", "name": "Alpha", "quotas": {"requests_per_minute": 10}}
BETA = {"id": "beta", "name": "Beta", "quotas": {}}


def key(kid: str, tenant: str = "alpha", role: str = "user") -> KeyRecord:
    return KeyRecord(id=kid, tenant=tenant, role=role,  # type: ignore[arg-type]
                     digest="sha256:" + kid.encode().hex().ljust(64, "0")[:64], created=1)


@pytest.fixture(params=["memory", "redis", "cluster"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[TenantStore]:
    if request.param == "memory":
        yield MemoryTenantStore()
        return
    prefix = f"t{uuid.uuid4().hex[:12]}"
    if request.param == "cluster":  # the registry's keys share one slot (docs/admission.md)
        url = request.getfixturevalue("redis_cluster").url
        s = RedisTenantStore(url, key_prefix=prefix, timeout_s=2.0, cluster=True)
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        s = RedisTenantStore(server.url, key_prefix=prefix, timeout_s=2.0)
    yield s
    await s.close()


async def test_an_empty_store_is_version_zero(store: TenantStore) -> None:
    assert await store.version() == 0
    snap = await store.snapshot()
    assert (snap.version, snap.tenants, snap.keys) == (0, {}, {})
    assert await store.get_tenant("alpha") is None


async def test_create_get_and_duplicate(store: TenantStore) -> None:
    v1 = await store.create_tenant(ALPHA)
    assert v1 > 0 and await store.version() == v1
    assert await store.get_tenant("alpha") == ALPHA
    with pytest.raises(TenantExists):
        await store.create_tenant({**ALPHA, "name": "other"})
    assert await store.version() == v1  # a refused write changes nothing
    assert await store.get_tenant("alpha") == ALPHA
    v2 = await store.create_tenant(BETA)
    assert v2 > v1
    snap = await store.snapshot()
    assert snap.version == v2 and snap.tenants == {"alpha": ALPHA, "beta": BETA}


async def test_replace_is_compare_and_set(store: TenantStore) -> None:
    v1 = await store.create_tenant(ALPHA)
    changed = {**ALPHA, "name": "Alpha 2"}
    v2 = await store.replace_tenant(changed, ALPHA)
    assert v2 > v1 and await store.get_tenant("alpha") == changed
    with pytest.raises(ChangedConcurrently):  # read before the change above
        await store.replace_tenant({**ALPHA, "name": "stale"}, ALPHA)
    assert await store.get_tenant("alpha") == changed and await store.version() == v2
    assert await store.replace_tenant(changed, changed) == v2  # no change, no new version
    with pytest.raises(NoSuchTenant):
        await store.replace_tenant(BETA, BETA)


async def test_racing_replaces_one_wins(store: TenantStore) -> None:
    await store.create_tenant(ALPHA)
    results = await asyncio.gather(
        *(store.replace_tenant({**ALPHA, "name": f"n{i}"}, ALPHA) for i in range(8)),
        return_exceptions=True)
    wins = [r for r in results if isinstance(r, int)]
    assert len(wins) == 1
    assert all(isinstance(r, ChangedConcurrently) for r in results if not isinstance(r, int))
    assert (await store.get_tenant("alpha"))["name"] == f"n{results.index(wins[0])}"


async def test_keys_belong_to_an_existing_tenant(store: TenantStore) -> None:
    with pytest.raises(NoSuchTenant):
        await store.add_key(key("k1"))
    v0 = await store.create_tenant(ALPHA)
    v1 = await store.add_key(key("k1"))
    assert v1 > v0
    with pytest.raises(KeyExists):
        await store.add_key(key("k1", role="tenant_admin"))
    await store.add_key(key("k2", role="tenant_admin"))
    snap = await store.snapshot()
    assert snap.keys == {"k1": key("k1"), "k2": key("k2", role="tenant_admin")}


async def test_delete_key_only_of_its_tenant(store: TenantStore) -> None:
    await store.create_tenant(ALPHA)
    await store.create_tenant(BETA)
    await store.add_key(key("k1"))
    before = await store.version()
    with pytest.raises(NoSuchKey):
        await store.delete_key("beta", "k1")  # alpha's key, asked as beta's
    with pytest.raises(NoSuchKey):
        await store.delete_key("alpha", "nope")
    assert await store.version() == before
    assert await store.delete_key("alpha", "k1") > before
    assert (await store.snapshot()).keys == {}
    with pytest.raises(NoSuchKey):
        await store.delete_key("alpha", "k1")


async def test_deleting_a_tenant_deletes_its_keys(store: TenantStore) -> None:
    await store.create_tenant(ALPHA)
    await store.create_tenant(BETA)
    for k in (key("a1"), key("a2", role="tenant_admin"), key("b1", "beta")):
        await store.add_key(k)
    before = await store.version()
    assert await store.delete_tenant("alpha") > before
    snap = await store.snapshot()
    assert list(snap.tenants) == ["beta"] and list(snap.keys) == ["b1"]
    with pytest.raises(NoSuchTenant):
        await store.delete_tenant("alpha")


async def test_seed_writes_only_what_is_absent(store: TenantStore) -> None:
    assert await store.seed([], []) == 0
    v0 = await store.version()
    assert v0 > 0  # seeded, even with nothing: 0 stays the mark of an empty store
    await store.create_tenant({**ALPHA, "name": "from the API"})
    written = await store.seed([ALPHA, BETA], [key("f1"), key("f2", "beta"),
                                               key("f3", "gamma")])
    assert written == 3  # beta, f1 (alpha exists) and f2; f3's tenant is nowhere
    snap = await store.snapshot()
    assert snap.tenants["alpha"]["name"] == "from the API"  # the store's record wins
    assert set(snap.tenants) == {"alpha", "beta"} and set(snap.keys) == {"f1", "f2"}
    v1 = snap.version
    assert await store.seed([ALPHA, BETA], [key("f1"), key("f2", "beta")]) == 0
    assert await store.version() == v1  # nothing written, no new version


async def test_seed_never_brings_back_what_the_api_deleted(store: TenantStore) -> None:
    await store.seed([ALPHA, BETA], [key("f1"), key("f2"), key("f3", "beta")])
    await store.delete_key("alpha", "f1")
    await store.delete_tenant("beta")
    assert await store.seed([ALPHA, BETA], [key("f1"), key("f2"), key("f3", "beta")]) == 0
    snap = await store.snapshot()
    assert set(snap.tenants) == {"alpha"} and set(snap.keys) == {"f2"}
    # created again through the API: the tenant is back; its deleted file key is not
    await store.create_tenant(BETA)
    assert await store.seed([BETA], [key("f3", "beta")]) == 0
    assert set((await store.snapshot()).keys) == {"f2"}


async def test_versions_only_grow(store: TenantStore) -> None:
    seen = [await store.version()]
    seen.append(await store.create_tenant(ALPHA))
    seen.append(await store.add_key(key("k")))
    seen.append(await store.replace_tenant({**ALPHA, "name": "x"}, ALPHA))
    seen.append(await store.delete_key("alpha", "k"))
    seen.append(await store.delete_tenant("alpha"))
    assert seen == sorted(set(seen)) and seen[-1] == await store.version()


# ---- Redis only ------------------------------------------------------------------------------
async def plant(store: TenantStore, table: str, rid: str, text: str) -> None:
    """Write a record as an older version, or a hand, might have: past every check."""
    if isinstance(store, MemoryTenantStore):
        (store._records if table == "tenants" else store._keys)[rid] = text
        return
    assert isinstance(store, RedisTenantStore)
    await store._redis.hset(store.keys[1 if table == "tenants" else 2], rid, text)


DEEP = "[" * 100_000 + "]" * 100_000  # past json.loads' recursion and cjson's depth limit


async def test_unreadable_records_never_fail_a_read_or_a_write(store: TenantStore) -> None:
    await store.create_tenant(ALPHA)
    await store.add_key(key("k1"))
    for tid, text in [("broken", "{not json"), ("deep", DEEP), ("list", "[1]"),
                      ("bytes", "\"\\udc80\"")]:
        await plant(store, "tenants", tid, text)
    good = key("k2").to_json()
    for kid, text in [("kbad", "{not json"), ("kdeep", DEEP), ("knum", "7"),
                      ("kinf", good.replace('"created":1', '"created":1e999')),
                      ("kpart", '{"tenant":"alpha"}'),
                      ("ksur", good.replace('"k2"', '"\\udc80"'))]:
        await plant(store, "keys", kid, text)
    snap = await store.snapshot()
    assert set(snap.tenants) == {"alpha"} and set(snap.keys) == {"k1"}
    assert sorted(snap.unreadable) == sorted(["broken", "deep", "list", "bytes", "kbad",
                                              "kdeep", "knum", "kinf", "kpart", "ksur"])
    for tid in ("broken", "deep", "list", "bytes"):
        with pytest.raises(InvalidRecord):
            await store.get_tenant(tid)
    with pytest.raises(NoSuchKey):
        await store.delete_key("alpha", "kbad")
    version = await store.version()
    assert await store.delete_tenant("alpha") > version  # whole: its keys go with it
    snap = await store.snapshot()
    assert snap.tenants == {} and snap.keys == {}
    assert "kpart" not in snap.unreadable  # it named alpha: deleted with it
    assert "kbad" in snap.unreadable  # names no tenant: left alone
    assert await store.delete_tenant("broken") > 0  # an operator can delete a bad record


async def test_writes_refuse_non_finite_numbers_before_storing(store: TenantStore) -> None:
    v = await store.create_tenant(ALPHA)
    for write in (store.create_tenant({"id": "x", "weight": float("inf")}),
                  store.replace_tenant({**ALPHA, "weight": float("nan")}, ALPHA),
                  store.seed([BETA, {"id": "y", "weight": float("-inf")}], [])):
        with pytest.raises(ValueError):
            await write
    assert await store.version() == v and await store.get_tenant("x") is None
    assert (await store.snapshot()).tenants == {"alpha": ALPHA}


async def test_a_record_with_infinity_from_an_older_version_can_be_replaced(
        store: TenantStore) -> None:
    await store.create_tenant(ALPHA)
    await plant(store, "tenants", "alpha", '{"id":"alpha","weight":Infinity}')
    old = await store.get_tenant("alpha")
    assert old == {"id": "alpha", "weight": float("inf")}
    await store.replace_tenant(ALPHA, old)
    assert await store.get_tenant("alpha") == ALPHA


@pytest.fixture
def lonely_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


async def test_redis_replicas_share_records_and_keys_share_one_slot(
        redis_server: RedisServer) -> None:
    prefix = f"t{uuid.uuid4().hex[:12]}"
    a = RedisTenantStore(redis_server.url, key_prefix=prefix)
    b = RedisTenantStore(redis_server.url, key_prefix=prefix)
    try:
        v = await a.create_tenant(ALPHA)
        assert v > 10**15  # starts at Redis TIME in µs: never repeats after a data loss
        assert await b.version() == v and await b.get_tenant("alpha") == ALPHA
        await b.add_key(key("k1"))
        assert (await a.snapshot()).keys == {"k1": key("k1")}
        assert len({key_slot(k.encode()) for k in a.keys}) == 1
        assert all(":{registry:tenants}:" in k for k in a.keys)
    finally:
        await a.close()
        await b.close()


async def test_redis_unreadable_records_are_skipped_and_named(
        redis_server: RedisServer) -> None:
    s = RedisTenantStore(redis_server.url, key_prefix=f"t{uuid.uuid4().hex[:12]}")
    raw = Redis.from_url(redis_server.url)
    try:
        await s.create_tenant(ALPHA)
        await raw.hset(s.keys[1], "broken", "{not json")
        await raw.hset(s.keys[2], "kbad", '{"id": "kbad"}')
        snap = await s.snapshot()
        assert set(snap.tenants) == {"alpha"} and snap.keys == {}
        assert sorted(snap.unreadable) == ["broken", "kbad"]
    finally:
        await s.close()
        await raw.aclose()


async def test_redis_down_is_store_unavailable_then_recovers(
        lonely_redis: RedisServer) -> None:
    s = RedisTenantStore(lonely_redis.url, timeout_s=0.2)
    try:
        await s.create_tenant(ALPHA)
        lonely_redis.stop()
        calls = [s.version(), s.snapshot(), s.get_tenant("alpha"), s.create_tenant(BETA),
                 s.replace_tenant(ALPHA, ALPHA), s.delete_tenant("alpha"),
                 s.add_key(key("k")), s.delete_key("alpha", "k"), s.seed([BETA], []),
                 s.ping()]
        for call in calls:
            with pytest.raises(StoreUnavailable):
                await call
        lonely_redis.start()  # no persistence: it comes back empty
        assert await s.version() == 0
        assert await s.seed([ALPHA], []) == 1
    finally:
        await s.close()
