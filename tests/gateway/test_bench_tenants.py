"""Many tenants and keys (issue #26): the auth lookup never scans, a reload after one change
is right at 10,000 tenants / 100,000 keys, and the bench runs end to end (--quick).

Sizes: the lookup and the in-memory reload run at the full 10,000 tenants / 100,000 keys
(~5 s together on a 2-core box); the Redis reload at 2,000 tenants / 20,000 keys (past
several seeding batches, ~3 s). No timing is asserted: scans are found by counting.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway import bench_tenants
from gateway.bench_tenants import bench_key, lines_run, tenant_id
from gateway.config import GatewayConfig, ModelEntry, StoreConfig, TenantEntry, TenantsFile
from gateway.errors import AuthenticationFailed
from gateway.registry import Registry, view_of
from gateway.tenants import KeyRing, Tenant, hash_key
from policies.tenant_store import SEED_BATCH, KeyRecord, MemoryTenantStore, RedisTenantStore
from tests.policies.conftest import RedisServer

PER_TENANT = bench_tenants.KEYS_PER_TENANT
ROOT = Path(__file__).resolve().parents[2]


def tenants_file(n: int) -> TenantsFile:
    return TenantsFile(tenants=[
        TenantEntry(id=tenant_id(t), keys=[hash_key(bench_key(t * PER_TENANT + k))
                                           for k in range(PER_TENANT)])
        for t in range(n)])


def ring(n: int) -> KeyRing:
    """A ring over n tenants and 10 n keys, built as a reload builds it."""
    built = {tenant_id(t): Tenant.from_entry(TenantEntry(id=tenant_id(t))) for t in range(n)}
    return KeyRing.from_records(built, ((hash_key(bench_key(i)), tenant_id(i // PER_TENANT))
                                        for i in range(n * PER_TENANT)))


def config(url: str | None = None) -> GatewayConfig:
    return GatewayConfig(models=[ModelEntry(name="m", upstream="http://127.0.0.1:9")],
                         store=StoreConfig(url=url))


# ---- the lookup does not scan --------------------------------------------------------------


def test_auth_runs_the_same_steps_at_100_and_at_100000_keys(
        monkeypatch: pytest.MonkeyPatch) -> None:
    small, large = ring(10), ring(10_000)
    assert (len(small), len(large)) == (100, 100_000)
    hashes: list[int] = []
    real_sha256 = hashlib.sha256

    def counted_sha256(data: bytes = b"") -> Any:
        hashes.append(1)
        return real_sha256(data)

    def no_compare(a: object, b: object) -> bool:
        raise AssertionError("the lookup compared digests one by one")

    monkeypatch.setattr(hashlib, "sha256", counted_sha256)
    monkeypatch.setattr(hmac, "compare_digest", no_compare)
    for r, n_keys in ((small, 100), (large, 100_000)):
        for i in (0, n_keys // 2, n_keys - 1):  # first, middle and last key of the ring
            header = f"Bearer {bench_key(i)}".encode()
            hashes.clear()
            tenant = r.authenticate(header)
            assert tenant.id == tenant_id(i // PER_TENANT)
            assert len(hashes) == 1, "one hash of the presented key per lookup, never more"
        with pytest.raises(AuthenticationFailed):
            r.authenticate(b"Bearer sk-not-a-key")
    monkeypatch.undo()
    # Python lines run per lookup: a loop over keys or tenants would grow with the ring.
    def lines_of(r: KeyRing, header: bytes) -> int:
        return lines_run(lambda: r.authenticate(header))

    for i in (0, 99):
        header = f"Bearer {bench_key(i)}".encode()
        assert lines_of(small, header) == lines_of(large, header)
    miss = b"Bearer sk-absent"

    def refused(r: KeyRing) -> int:
        def call() -> None:
            with pytest.raises(AuthenticationFailed):
                r.authenticate(miss)
        return lines_run(call)

    assert refused(small) == refused(large)


# ---- a reload after one change, at size ----------------------------------------------------


def check_against_a_fresh_load(reg: Registry, snap_view: Any) -> None:
    """What the incremental reload built equals a load from scratch, key by key."""
    assert reg.tenants.keys() == snap_view.users.tenants.keys()
    for tid, tenant in reg.tenants.items():
        assert tenant == snap_view.users.tenants[tid], tid
    assert reg._view.users._by_digest.keys() == snap_view.users._by_digest.keys()
    for digest, tenant in reg._view.users._by_digest.items():
        assert tenant.id == snap_view.users._by_digest[digest].id


async def change_one_of_each(reg: Registry, n: int) -> dict[str, Any]:
    """One tenant changed, one deleted (with its keys), one key added, one key deleted."""
    store = reg.store
    changed, gone = tenant_id(n // 2), tenant_id(n - 1)
    record = await store.get_tenant(changed)
    assert record is not None
    await store.replace_tenant({**record, "name": "renamed"}, record)
    await store.delete_tenant(gone)
    await store.add_key(KeyRecord(id="key_00000000000000aa", tenant=tenant_id(0), role="user",
                                  digest=hash_key("sk-new"), created=2))
    snap = await store.snapshot()
    deleted_key = next(k for k in snap.keys.values() if k.tenant == tenant_id(1))
    await store.delete_key(tenant_id(1), deleted_key.id)
    return {"changed": changed, "gone": gone, "deleted_digest": deleted_key.digest}


async def reload_is_right(reg: Registry, n: int, fresh_snapshot: Any) -> None:
    assert await reg.sync() and len(reg.tenants) == n
    before = dict(reg.tenants)
    what = await change_one_of_each(reg, n)
    validated: list[str] = []
    real = TenantEntry.model_validate

    def counted(record: Any) -> TenantEntry:
        validated.append(record["id"])
        return real(record)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TenantEntry, "model_validate", counted)
        assert await reg.sync()
    assert validated == [what["changed"]], "the reload validated more than the changed tenant"
    assert reg.tenants[what["changed"]].name == "renamed"
    assert what["gone"] not in reg.tenants and len(reg.tenants) == n - 1
    untouched = [tid for tid in reg.tenants if tid != what["changed"]]
    assert all(reg.tenants[tid] is before[tid] for tid in untouched)  # reused, not rebuilt
    assert reg.lookup(b"sk-new") is reg.tenants[tenant_id(0)]
    gone_first_key = (n - 1) * PER_TENANT
    assert reg.lookup(bench_key(gone_first_key).encode()) is None
    # the changed tenant's keys now lead to its new Tenant
    assert reg.lookup(bench_key(n // 2 * PER_TENANT).encode()) is reg.tenants[what["changed"]]
    assert bytes.fromhex(what["deleted_digest"][7:]) not in reg._view.users._by_digest
    check_against_a_fresh_load(reg, view_of(await fresh_snapshot()))


async def test_reload_after_one_change_at_10000_tenants_in_memory() -> None:
    n = 10_000
    reg = Registry(config(), tenants_file(n), MemoryTenantStore())

    async def fresh() -> Any:  # a second parse of the same store, nothing reused
        store = reg.store
        assert isinstance(store, MemoryTenantStore)
        from policies.tenant_store import Snapshot
        return Snapshot.parse(store._version, store._records, store._keys)

    await reload_is_right(reg, n, fresh)
    assert len(reg._view.users) == n * PER_TENANT - PER_TENANT  # one tenant's keys went


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis-many"))
    server.start()
    yield server
    server.stop()


async def test_reload_after_one_change_over_redis_in_seeding_batches(
        redis_server: RedisServer) -> None:
    n = 2_000
    assert n * PER_TENANT > 10 * SEED_BATCH  # keys go in many batches
    prefix = f"many{uuid.uuid4().hex[:8]}"
    reg = Registry(config(redis_server.url), tenants_file(n),
                   RedisTenantStore(redis_server.url, key_prefix=prefix))
    fresh_store = RedisTenantStore(redis_server.url, key_prefix=prefix)
    try:
        await reload_is_right(reg, n, fresh_store.snapshot)
        # a replica starting now seeds nothing new and loads the same registry
        replica = Registry(config(redis_server.url), tenants_file(n),
                           RedisTenantStore(redis_server.url, key_prefix=prefix))
        assert await replica.sync()
        check_against_a_fresh_load(replica, reg._view)
        await replica.aclose()
    finally:
        await reg.aclose()
        await fresh_store.close()


# ---- the bench, end to end -----------------------------------------------------------------


def test_the_bench_runs_end_to_end_quick() -> None:
    out = subprocess.run([sys.executable, "-m", "gateway.bench_tenants", "--quick"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("python -m gateway.bench_tenants --quick")
    rows = {cells[0]: cells[2:] for cells in (re.split(r"\s{2,}", line.strip())
                                              for line in lines[2:])}
    for _, label, _ in bench_tenants.TABLE:
        assert label.strip() in rows, label
    sizes = bench_tenants.QUICK
    assert re.split(r"\s{2,}", lines[1].strip())[2:] == [
        f"{n:,} t / {n * PER_TENANT:,} keys" for n in sizes] + ["last/first"]
    # the lookup runs the same lines at every size: the ratio is exactly 1
    auth_lines = rows["auth: Python lines run"]
    assert len(set(auth_lines[:-1])) == 1 and auth_lines[-1] == "1.00x"
