"""Many tenants and keys (issue #26): what 10,000 tenants and 100,000 keys cost a registry.

    python -m gateway.bench_tenants            # 10, 1,000 and 10,000 tenants (10 keys each)
    python -m gateway.bench_tenants --quick    # 10, 100 and 1,000 tenants

Every figure is measured side by side in one run, at each size of the ladder, against a
``redis-server`` the bench starts (no persistence, a free 127.0.0.1 port, stopped by PID)
and against the in-memory store seeded from a ``tenants.yaml`` it writes:

    start-up   parse and validate tenants.yaml; seed and load the memory store; seed an
               empty Redis and load it; a second replica loading a Redis that has them
    reload     one tenant changed through the store: the other replica's next poll (a
               full reload), split into the read of the store and the build of the rings;
               a poll that finds the version unchanged
    memory     what a loaded registry holds (tracemalloc): per tenant, per key; Redis's
               used_memory per key record
    auth       ``Registry.authenticate`` from a bearer header to its tenant, a hit and a
               miss, and the Python lines it runs (the same at every size: no scan)
    admin      GET /admin/v1/tenants through the real handler: the first page after a
               change (the listing rebuilt), then warm, and a middle page by cursor

Docs: docs/admin.md, "Many tenants and keys". Nothing here is imported by the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, SimpleNamespace
from typing import Any

import httpx
from redis.asyncio import Redis
from redis.utils import HIREDIS_AVAILABLE
from starlette.applications import Starlette

from policies.redis_child import redis_child
from policies.tenant_store import MemoryTenantStore, RedisTenantStore, Snapshot

from .admin import admin_routes
from .config import GatewayConfig, ModelEntry, StoreConfig, load_tenants
from .errors import AuthenticationFailed
from .paging import encode_cursor
from .registry import Registry, View, view_of
from .tenants import hash_key

KEYS_PER_TENANT = 10
FULL = (10, 1_000, 10_000)
QUICK = (10, 100, 1_000)
OPERATOR = "bench-operator-key"
LOOKUPS = 2_000  # distinct keys looked up per timing pass


def bench_key(i: int) -> str:
    return f"sk-bench-{i:08d}"


def tenant_id(i: int) -> str:
    return f"t-{i:06d}"


def tenants_yaml(tenants: int, per_tenant: int = KEYS_PER_TENANT) -> str:
    """A tenants file: tenant i holds keys i*per_tenant .. (i+1)*per_tenant-1 (digests)."""
    lines = ["tenants:"]
    for t in range(tenants):
        lines += [f"- id: {tenant_id(t)}", f"  name: Bench tenant {t}",
                  "  models: ['*']",
                  "  quotas: {tokens_per_minute: 100000, requests_per_minute: 600}",
                  "  keys:"]
        lines += [f"  - {hash_key(bench_key(t * per_tenant + k))}" for k in range(per_tenant)]
    return "\n".join(lines) + "\n"


def config(url: str | None = None) -> GatewayConfig:
    return GatewayConfig(models=[ModelEntry(name="m", upstream="http://127.0.0.1:9")],
                         store=StoreConfig(url=url))


# ---- measuring ----------------------------------------------------------------------------


async def timed(call: Awaitable[Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    result = await call
    return time.perf_counter() - t0, result


def best_ns(fn: Callable[[], None], n: int, repeat: int = 5) -> float:
    """The best of ``repeat`` passes of ``fn`` (which does ``n`` operations), ns each."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best


def lines_run(fn: Callable[[], object]) -> int:
    """How many Python lines ``fn`` runs (sys.settrace): a scan over keys would grow it."""
    count = 0

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def retained(build: Callable[[], Any]) -> int:
    """Bytes still allocated (tracemalloc) once ``build`` returned, what it built held."""
    gc.collect()
    tracemalloc.start()
    try:
        held = build()
        gc.collect()
        size = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del held
    return size


def loaded(tenants: dict[bytes, bytes], keys: dict[bytes, bytes]) -> tuple[Snapshot, View]:
    """What a replica holds once loaded: the store's last snapshot (texts and parsed records,
    kept for the next reload) and the rings. The texts are copied here, as a read makes
    them (the read itself is left out: redis-py's parser crawls under tracemalloc)."""
    snap = Snapshot.parse(1, {k.decode(): bytes(memoryview(v)) for k, v in tenants.items()},
                          {k.decode(): bytes(memoryview(v)) for k, v in keys.items()})
    return snap, view_of(snap)


@dataclass
class Row:
    """One size of the ladder: every figure, by name, in seconds / ns / bytes."""

    tenants: int
    keys: int
    figures: dict[str, float | str] = field(default_factory=dict)


async def measure(row: Row, workdir: Path, redis_url: str, say: Callable[[str], None]) -> None:
    f = row.figures
    n = row.tenants
    path = workdir / f"tenants-{n}.yaml"
    path.write_text(tenants_yaml(n))
    t0 = time.perf_counter()
    tenants = load_tenants(path)
    f["parse_s"] = time.perf_counter() - t0
    say(f"  {n} tenants: tenants.yaml parsed in {f['parse_s']:.3f} s")

    # In memory: the Registry built from the file, then seeding and loading the store.
    t0 = time.perf_counter()
    memory = Registry(config(), tenants, MemoryTenantStore())
    f["file_ring_s"] = time.perf_counter() - t0
    f["memory_start_s"], ok = await timed(memory.sync())
    check(ok and len(memory.tenants) == n, "the memory registry did not load")

    # Redis: replica A seeds an empty store; replica B starts against the seeded store.
    prefix = f"bench{n}"
    rcfg = config(redis_url)
    redis = Redis.from_url(redis_url)
    used0 = int((await redis.info("memory"))["used_memory"])
    a = Registry(rcfg, tenants, RedisTenantStore(redis_url, key_prefix=prefix))
    f["redis_seed_start_s"], ok = await timed(a.sync())
    f["redis_used_per_key_b"] = (int((await redis.info("memory"))["used_memory"]) - used0) \
        / max(1, row.keys + n)
    b = Registry(rcfg, tenants, RedisTenantStore(redis_url, key_prefix=prefix))
    f["redis_replica_start_s"], ok_b = await timed(b.sync())
    check(ok and ok_b and len(b.tenants) == n, f"the Redis registries did not load ({ok}, {ok_b})")
    f["redis_idle_poll_s"], _ = await timed(b.sync())

    # One tenant changed: B's next poll reloads; then its parts, read and build.
    changed = tenant_id(n // 2)
    record = await a.store.get_tenant(changed)
    assert record is not None
    await a.store.replace_tenant({**record, "name": "renamed"}, record)
    f["reload_one_change_s"], ok = await timed(b.sync())
    check(ok and b.tenants[changed].name == "renamed", "the change did not reach replica B")
    # its parts, after one more change: the read (texts compared, one record parsed) and
    # the build (one tenant validated); then the same from scratch, nothing reused
    await a.store.replace_tenant({**record, "name": "twice"}, {**record, "name": "renamed"})
    previous = b._view
    f["reload_read_s"], snap = await timed(b.store.snapshot())
    t0 = time.perf_counter()
    view_of(snap, previous)
    f["reload_build_s"] = time.perf_counter() - t0
    fresh = RedisTenantStore(redis_url, key_prefix=prefix)
    f["full_read_s"], snap = await timed(fresh.snapshot())
    t0 = time.perf_counter()
    view_of(snap)
    f["full_build_s"] = time.perf_counter() - t0
    await fresh.close()

    # Memory a loaded registry holds: without keys, then with them.
    store = b.store
    assert isinstance(store, RedisTenantStore)
    raw_tenants: dict[bytes, bytes] = await redis.hgetall(store.keys[1])  # type: ignore[assignment]
    raw_keys: dict[bytes, bytes] = await redis.hgetall(store.keys[2])  # type: ignore[assignment]
    without = retained(lambda: loaded(raw_tenants, {}))
    with_keys = retained(lambda: loaded(raw_tenants, raw_keys))
    f["mem_per_tenant_b"] = without / n
    f["mem_per_key_b"] = (with_keys - without) / max(1, row.keys)

    auth(row, b)
    await admin_pages(row, a, b)
    await redis.aclose()
    for r in (memory, a, b):
        await r.aclose()


def check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"bench_tenants: {what}")


def auth(row: Row, registry: Registry) -> None:
    rng = random.Random(row.keys)
    picks = [rng.randrange(row.keys) for _ in range(LOOKUPS)]
    hits = [f"Bearer {bench_key(i)}".encode() for i in picks]
    misses = [f"Bearer sk-absent-{i:08d}".encode() for i in picks]
    for header, i in zip(hits[:50], picks[:50], strict=True):
        check(registry.authenticate(header).id == tenant_id(i // KEYS_PER_TENANT),
              "a key authenticated as the wrong tenant")

    def hit() -> None:
        for h in hits:
            registry.authenticate(h)

    def miss() -> None:
        for h in misses:
            try:
                registry.authenticate(h)
            except AuthenticationFailed:
                pass

    row.figures["auth_hit_ns"] = best_ns(hit, len(hits))
    row.figures["auth_miss_ns"] = best_ns(miss, len(misses))
    row.figures["auth_lines"] = lines_run(lambda: registry.authenticate(hits[0]))


async def admin_pages(row: Row, a: Registry, b: Registry) -> None:
    """GET /admin/v1/tenants on replica B through the real handler (httpx, in process)."""
    app = Starlette(routes=admin_routes({"SLUICE_ADMIN_KEY": OPERATOR}))
    app.state.gateway = SimpleNamespace(registry=b)
    headers = {"authorization": f"Bearer {OPERATOR}"}
    middle = encode_cursor("tenants", (tenant_id(row.tenants // 2),))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://bench", headers=headers) as client:
        async def get(params: dict[str, str]) -> None:
            r = await client.get("/admin/v1/tenants", params=params)
            check(r.status_code == 200, f"admin list answered {r.status_code}: {r.text[:200]}")

        row.figures["page_cold_s"], _ = await timed(get({"limit": "100"}))
        row.figures["page_first_s"] = min([(await timed(get({"limit": "100"})))[0]
                                           for _ in range(5)])
        row.figures["page_middle_s"] = min([(await timed(get({"limit": "100",
                                                              "cursor": middle})))[0]
                                            for _ in range(5)])
        # after a change elsewhere: the next page re-reads and re-indexes the store
        record = await a.store.get_tenant(tenant_id(0))
        assert record is not None
        await a.store.replace_tenant({**record, "name": "again"}, record)
        row.figures["page_after_change_s"], _ = await timed(get({"limit": "100",
                                                                 "cursor": middle}))


# ---- the report ---------------------------------------------------------------------------

TABLE: list[tuple[str, str, str]] = [  # (figure, label, unit)
    ("parse_s", "tenants.yaml parse + validate", "ms"),
    ("file_ring_s", "Registry() from the file (key ring)", "ms"),
    ("memory_start_s", "start, memory store (seed + load)", "ms"),
    ("redis_seed_start_s", "start, empty Redis (seed + load)", "ms"),
    ("redis_replica_start_s", "start, Redis already seeded", "ms"),
    ("redis_idle_poll_s", "poll, version unchanged", "ms"),
    ("reload_one_change_s", "reload after one tenant changed", "ms"),
    ("reload_read_s", "  of which: read the store", "ms"),
    ("reload_build_s", "  of which: build the rings", "ms"),
    ("full_read_s", "full reload: read, nothing reused", "ms"),
    ("full_build_s", "full reload: build, nothing reused", "ms"),
    ("mem_per_tenant_b", "registry memory per tenant", "B"),
    ("mem_per_key_b", "registry memory per key", "B"),
    ("redis_used_per_key_b", "Redis used_memory per record", "B"),
    ("auth_hit_ns", "auth: bearer -> tenant (hit)", "us"),
    ("auth_miss_ns", "auth: unknown key (401)", "us"),
    ("auth_lines", "auth: Python lines run", "lines"),
    ("page_cold_s", "admin list: first page, cold", "ms"),
    ("page_first_s", "admin list: first page", "ms"),
    ("page_middle_s", "admin list: middle page (cursor)", "ms"),
    ("page_after_change_s", "admin list: page after a change", "ms"),
]


def cell(value: float | str, unit: str) -> str:
    if isinstance(value, str):
        return value
    if unit == "ms":
        return f"{value * 1e3:.2f}"
    if unit == "us":
        return f"{value / 1e3:.2f}"
    return f"{value:.0f}"


def report(rows: list[Row]) -> str:
    head = ["figure", "unit"] + [f"{r.tenants:,} t / {r.keys:,} keys" for r in rows] + [
        "last/first"]
    body = []
    for name, label, unit in TABLE:
        values = [r.figures.get(name, "-") for r in rows]
        first, last = values[0], values[-1]
        ratio = f"{last / first:.2f}x" if isinstance(first, float | int) and isinstance(
            last, float | int) and first else "-"
        body.append([label, unit] + [cell(v, unit) for v in values] + [ratio])
    widths = [max(len(str(line[i])) for line in [head, *body]) for i in range(len(head))]
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    return "\n".join(fmt.format(*line) for line in [head, *body])


async def run(sizes: tuple[int, ...], say: Callable[[str], None]) -> list[Row]:
    rows = [Row(n, n * KEYS_PER_TENANT) for n in sizes]
    with tempfile.TemporaryDirectory(prefix="bench-tenants-") as tmp, \
            redis_child("bench-tenants-redis-") as server:
        say(f"redis-server on 127.0.0.1:{server.port} (pid {server.proc.pid}, no persistence)")
        for row in rows:
            await measure(row, Path(tmp), server.url, say)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.bench_tenants",
                                     description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true",
                        help=f"sizes {QUICK} tenants instead of {FULL}")
    parser.add_argument("--sizes", type=lambda s: tuple(int(x) for x in s.split(",")),
                        help="tenant counts, comma-separated (10 keys each)")
    args = parser.parse_args(argv)
    sizes: tuple[int, ...] = args.sizes or (QUICK if args.quick else FULL)

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    rows = asyncio.run(run(sizes, say))
    print(f"python -m gateway.bench_tenants{' --quick' if args.quick else ''}: "
          f"{KEYS_PER_TENANT} keys per tenant; Python {sys.version.split()[0]}, "
          f"{os.cpu_count()} CPUs; redis-py parser: "
          f"{'hiredis' if HIREDIS_AVAILABLE else 'pure Python (no hiredis)'}; "
          f"{time.perf_counter() - t0:.0f} s")
    print(report(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
