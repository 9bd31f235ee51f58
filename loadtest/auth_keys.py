"""What a large key set costs authentication, measured side by side in one run.

    python -m loadtest.auth_keys [--quick] [--json FILE] [--keys N] [--rate R] [--self-check]

Starts `sluice fake-upstream` and two `sluice gateway` processes in front of it, alike but
for their tenants file: one holds 10 keys, the other --keys (default 100,000), both laid
out as KEYS_PER_TENANT keys per tenant (100,000 keys: 1,000 tenants) and stored as
``sha256:`` digests only. Each gateway's start-up time (spawn to /healthz 200: reading,
validating and indexing the tenants file is most of it) and resident memory are read.
Then both get the same open-loop streamed chat load, interleaved in short segments as
the overhead bench does (docs/overhead.md, Method), each request carrying the next of a
fixed list of keys spread across that gateway's key set: the first, the middle, the last,
then seeded random ones. Prints p50 and p99 (E2E and TTFT) of each gateway and the ratio
p50(N keys) / p50(10 keys) against issue #21's target, <= 1.05. --self-check gives both
gateways 10 keys: the method must then find ~1.00. Nothing is asserted; --json writes
every figure. See docs/overhead.md, "Authentication at 100,000 keys".
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import math
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from loadtest import targets as procs
from loadtest.isolation import rss_mib
from loadtest.load_client import Pool, Sample
from loadtest.measure import MAX_ERROR_SHARE, Stats, Target, chat_request, interleaved, warm_up
from loadtest.overhead import CHUNKS, Plan, _revision, _table
from loadtest.report import run_bench, say, verdict, write_report

GOAL_P50_RATIO = 1.05  # issue #21: p50 at N keys <= 1.05 x p50 at 10 keys
SMALL_KEYS = 10
KEYS_PER_TENANT = 100  # a team's or a customer's keys under one tenant
REQUEST_KEYS = 64  # distinct keys the requests take turns with, per gateway
SEED = 21


def bench_key(i: int) -> str:
    """The i-th bench key: deterministic, shaped like the admin API's (``sk-`` + 43
    base64url characters)."""
    raw = hashlib.sha256(b"sluice/auth-bench\0%d" % i).digest()
    return "sk-" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def tenant_sizes(keys: int, per_tenant: int = KEYS_PER_TENANT) -> list[int]:
    """How many keys each tenant holds: `per_tenant` each, the last one the rest."""
    full, rest = divmod(keys, per_tenant)
    return [per_tenant] * full + ([rest] if rest else [])


def tenants_yaml(keys: int, per_tenant: int = KEYS_PER_TENANT) -> str:
    """A tenants file with keys 0 .. keys-1 (`bench_key`), as digests, `per_tenant` a
    tenant; each tenant's policy is the overhead bench's (caps far above the load)."""
    lines = ["tenants:"]
    first = 0
    for t, size in enumerate(tenant_sizes(keys, per_tenant)):
        lines += [f"  - id: auth-{t:05d}",
                  f"    models: [{procs.MODEL}]",
                  "    priority: {min: 0, max: 10, default: 5}",
                  "    caps: {max_prompt_tokens: 100000, max_tokens: 100000, on_exceed: reject}",
                  "    keys:"]
        lines += [f'      - "{procs.hash_key(bench_key(i))}"' for i in range(first, first + size)]
        first += size
    return "\n".join(lines) + "\n"


def request_keys(keys: int, count: int = REQUEST_KEYS, seed: int = SEED) -> list[int]:
    """Which keys the requests use, in turn: the first, the middle and the last of the key
    set, then seeded random ones (with repeats when the set is small)."""
    rng = random.Random(seed)
    spread = [0, keys // 2, keys - 1]
    return (spread + [rng.randrange(keys) for _ in range(count - len(spread))])[:count]


@dataclass(slots=True)
class KeyedPool(Pool):
    """A `Pool` whose requests take turns among pre-built requests, one per key.

    Exact while every send finds an idle connection (``interleaved`` warms them): one sent
    without waits for a connection and then carries whichever key is current (the report's
    `opened_off_schedule` counts those)."""

    requests: tuple[bytes, ...] = ()
    sent: int = field(default=0, init=False)

    def send(self, sample: Sample) -> None:
        self.request = self.requests[self.sent % len(self.requests)]
        self.sent += 1
        Pool.send(self, sample)  # no zero-argument super() in a slots dataclass


def keyed_pool(port: int, keys: list[int]) -> KeyedPool:
    requests = tuple(chat_request(port, bench_key(i)) for i in keys)
    return KeyedPool("127.0.0.1", port, requests[0], requests=requests)


@dataclass(slots=True)
class Gateway:
    """A started gateway and what its start cost."""

    name: str
    keys: int
    tenants: int
    service: procs.Service
    startup_s: float
    rss_mib: float


def start_keyed_gateway(workdir: Path, up_port: int, name: str, keys: int,
                        per_tenant: int) -> Gateway:
    """`sluice gateway` on the overhead bench's gateway.yaml, with a tenants file of `keys`
    keys; timed from spawn to its first /healthz 200."""
    home = workdir / name.replace(" ", "-")
    home.mkdir()
    (home / "tenants.yaml").write_text(tenants_yaml(keys, per_tenant))
    port = procs.free_port()
    config = home / "gateway.yaml"
    config.write_text(procs.gateway_yaml(port, up_port))
    unset = procs.gateway_env_unset(os.environ) + tuple(
        k for k in os.environ if k.startswith("OTEL_"))
    started = time.monotonic()
    service = procs._spawn(name.replace(" ", "-"),
                           [sys.executable, "-m", "sluice.cli", "gateway", "--config",
                            str(config), "--log-level", "warning"], port, home, unset=unset)
    procs._ready_or_stop(service, "/healthz", 60 + keys / 1000)  # ~1 ms a key: generous
    startup = time.monotonic() - started
    return Gateway(name, keys, len(tenant_sizes(keys, per_tenant)), service, startup,
                   rss_mib(service.proc.pid))


def p50_ratio(small: Stats, big: Stats) -> float:
    return big.e2e_p50_ms / small.e2e_p50_ms if small.e2e_p50_ms > 0 else math.nan


def judge(small: Stats, big: Stats, big_name: str,
          goal: float = GOAL_P50_RATIO) -> list[dict[str, Any]]:
    """The verdict on p50(big) / p50(small): n/a without figures, a miss when either side
    had >= 1 % errors (a key that did not authenticate, say)."""
    ratio = p50_ratio(small, big)
    clean = small.error_share < MAX_ERROR_SHARE and big.error_share < MAX_ERROR_SHARE
    ok = None if math.isnan(ratio) else (ratio <= goal and clean)
    out = [verdict(f"e2e p50 ratio {big_name} / {SMALL_KEYS} keys (<= {goal:g})", ratio, ok)]
    if not clean:
        say(f"    errors: {SMALL_KEYS} keys {small.error_share:.1%}, {big_name} "
            f"{big.error_share:.1%} (>= {MAX_ERROR_SHARE:.0%}: the run does not count)")
    return out


async def _bench(args: argparse.Namespace, plan: Plan, workdir: Path,
                 stack: contextlib.ExitStack) -> dict[str, Any]:
    big_keys = SMALL_KEYS if args.self_check else args.keys
    report: dict[str, Any] = {
        "goal_p50_ratio": GOAL_P50_RATIO, "plan": asdict(plan), "chunks": CHUNKS,
        "keys_per_tenant": args.keys_per_tenant, "self_check": args.self_check,
        "machine": {"cpus": len(os.sched_getaffinity(0)), "python": platform.python_version(),
                    "platform": platform.platform()}, "revision": _revision()}
    say(f"sluice {report['revision']}, {report['machine']['cpus']} CPUs, "
        f"python {report['machine']['python']}")
    up = procs.start_fake_upstream(workdir, CHUNKS)
    stack.callback(up.stop)
    gateways: list[Gateway] = []
    # one after the other: each start has the cores to itself
    for name, keys in ((f"{SMALL_KEYS} keys", SMALL_KEYS),
                       (f"{big_keys} keys{' again' if args.self_check else ''}", big_keys)):
        gw = start_keyed_gateway(workdir, up.port, name, keys, args.keys_per_tenant)
        stack.callback(gw.service.stop)
        gateways.append(gw)
        say(f"  {name:<16} {gw.tenants:>6} tenants, start-up {gw.startup_s:6.2f} s "
            f"(spawn to /healthz 200), RSS {gw.rss_mib:6.1f} MiB")
    report["gateways"] = {g.name: {"keys": g.keys, "tenants": g.tenants,
                                   "startup_s": round(g.startup_s, 3),
                                   "rss_mib": round(g.rss_mib, 1),
                                   "request_keys": request_keys(g.keys)} for g in gateways}
    targets = [Target(g.name, keyed_pool(g.service.port, request_keys(g.keys)),
                      g.service.cpu_seconds) for g in gateways]
    try:
        started = time.monotonic()
        await warm_up(targets)
        stats = await interleaved(targets, plan.rate, plan.seconds, plan.segment_s, CHUNKS)
        for target in targets:
            report["gateways"][target.name]["opened_off_schedule"] = target.pool.connecting
    finally:
        for target in targets:
            await target.pool.close()
    small, big = gateways[0].name, gateways[1].name
    report["at_rate"] = {k: asdict(v) for k, v in stats.items()}
    say("")
    _table(f"{plan.rate:g} requests/s streamed chat ({CHUNKS} chunks), {plan.seconds:g} s per "
           f"gateway, interleaved in {plan.segment_s:g} s segments; each gateway's requests "
           f"take turns among {REQUEST_KEYS} of its keys", stats, small)
    say(f"\n  start-up: {small} {gateways[0].startup_s:.2f} s, {big} "
        f"{gateways[1].startup_s:.2f} s; RSS {gateways[0].rss_mib:.1f} / "
        f"{gateways[1].rss_mib:.1f} MiB")
    say("\ntarget (issue #21):")
    report["p50_ratio"] = p50_ratio(stats[small], stats[big])
    report["verdicts"] = judge(stats[small], stats[big], big)
    report["measure_seconds"] = round(time.monotonic() - started, 1)
    say(f"\nmeasured in {report['measure_seconds']:.0f} s")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.auth_keys",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short run (< 1 minute)")
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    parser.add_argument("--keys", type=int, default=100_000,
                        help="keys of the large gateway (default 100000)")
    parser.add_argument("--keys-per-tenant", type=int, default=KEYS_PER_TENANT,
                        help=f"keys per tenant, in both files (default {KEYS_PER_TENANT})")
    parser.add_argument("--rate", type=float, default=200.0,
                        help="requests/s at each gateway (default 200)")
    parser.add_argument("--self-check", action="store_true",
                        help=f"both gateways with {SMALL_KEYS} keys (expect a ratio ~1.00)")
    args = parser.parse_args(argv)
    if args.keys < 1 or args.keys_per_tenant < 1:
        parser.error("--keys and --keys-per-tenant must be >= 1")
    if args.rate <= 0:
        parser.error("--rate must be > 0")
    plan = (replace(Plan.quick(args.rate), seconds=6.0) if args.quick
            else replace(Plan(rate=args.rate), seconds=30.0))
    status, report = run_bench("auth_keys", lambda tmp, stack: _bench(args, plan, tmp, stack))
    if status:
        return status
    write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
