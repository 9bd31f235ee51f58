"""Failover and routing benchmark: two bundled backends behind one `sluice gateway`.

    python -m loadtest.failover [--duration 20] [--kill-at 8] [--prefix-duration 30]

Part 1, failover. Measure the pool's capacity (closed loop), then send Poisson arrivals at
70 % of it (open loop, seeded) and SIGKILL one backend mid-run. Printed side by side:
* failed requests vs the requests in flight on the killed backend at the kill (the
  gateway's ``slots_held`` for that member, scraped just before);
* the time until goodput (successful completions per second, 1 s windows) is back to
  90 % of what the survivor can carry (the lesser of the offered rate and half the pool's
  capacity), vs the target: the breaker cooldown + 2 s.
Part 2, routing. ``configs/workloads/prefix.yaml`` (shortened to ``--prefix-duration``)
through the load generator, once with least-load routing and once prefix-affine: the
backends' prefix-cache hit rate (hits / lookups, and prompt tokens saved / prompt tokens
looked up) and TTFT p50 / p95, side by side.

It talks to the gateway over HTTP only; processes are started here and stopped by PID.
Performance lives here, never in timed test asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtest.targets import Service, _spawn, free_port, hash_key, wait_ready

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-demo-alpha"
COOLDOWN_S = 2.0
# Per backend in the routing part: 2,560 tokens, room for the running requests and about
# four of prefix.yaml's eight 400-token documents, so that where requests go decides what
# stays cached (with the default ~131k-token cache each backend would keep all eight).
PREFIX_KV_BLOCKS = 160
BODY = {"model": "sluice-tiny", "messages": [{"role": "user", "content": "count to ten"}],
        "max_tokens": 32, "ignore_eos": True, "stream": True}


class Stack:
    """Two backends and a gateway pooling them, in a temporary directory."""

    def __init__(self, tmp: Path, routing: str, kv_blocks: int | None = None) -> None:
        self.tmp = tmp
        kv = ["--kv-blocks", str(kv_blocks)] if kv_blocks else []
        self.backends: list[Service] = []
        self.gateway: Service | None = None
        # the backends' API key: they get it, the gateway sends it (api_key_env)
        key = {"SLUICE_BACKEND_API_KEY": secrets.token_urlsafe(24)}
        self.backend_headers = {"authorization": f"Bearer {key['SLUICE_BACKEND_API_KEY']}"}
        for _ in range(2):
            p = free_port()
            self.backends.append(_spawn(f"backend-{p}", [
                sys.executable, "-m", "sluice.cli", "backend", "--model", "tiny", "--port",
                str(p), "--log-level", "warning", *kv], p, tmp, env=key))
        self.urls = [f"http://127.0.0.1:{b.port}" for b in self.backends]
        for b in self.backends:
            _ready(self, b, "/health")
        port = free_port()
        digest = hash_key(KEY)
        (tmp / "tenants.yaml").write_text(yaml.safe_dump({"tenants": [
            {"id": "alpha", "keys": [digest], "priority": {"min": 0, "max": 10,
                                                           "default": 5}}]}))
        (tmp / "gateway.yaml").write_text(yaml.safe_dump({
            "listen": {"port": port}, "tenants_file": "tenants.yaml",
            "timeouts": {"connect_s": 1.0, "first_byte_s": 10.0, "idle_s": 10.0},
            "queue": {"max_len": 4096},
            "resilience": {"breaker": {"consecutive_failures": 5, "cooldown_s": COOLDOWN_S}},
            "models": [{"name": "sluice-tiny", "upstreams": self.urls, "kind": "sluice",
                        "tokenizer": "local:tiny", "routing": routing,
                        "api_key_env": "SLUICE_BACKEND_API_KEY"}]}))
        self.url = f"http://127.0.0.1:{port}"
        self.gateway = _spawn("gateway", [sys.executable, "-m", "sluice.cli", "gateway",
                                          "--config", str(tmp / "gateway.yaml"),
                                          "--log-level", "warning"], port, tmp, env=key)
        _ready(self, self.gateway, "/readyz")

    def metric(self, prefix: str) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line.startswith(prefix):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def states(self) -> list[dict[str, Any]]:
        out = []
        for url in self.urls:
            try:
                out.append(httpx.get(url + "/v1/state", headers=self.backend_headers,
                                     timeout=5).json())
            except httpx.HTTPError:
                out.append({})
        return out

    def close(self) -> None:
        for service in (self.gateway, *self.backends):
            if service is not None:
                service.stop()


def _ready(stack: Stack, service: Service, path: str) -> None:
    """Wait for ``service``; if it never comes up, stop what the stack started and raise."""
    try:
        wait_ready(service, path, 60)
    except BaseException:
        stack.close()
        raise


# ---- part 1: failover ----------------------------------------------------------------------
async def _one(client: httpx.AsyncClient, url: str, out: list[dict[str, Any]]) -> None:
    rec: dict[str, Any] = {"start": time.monotonic(), "ok": False, "why": ""}
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=BODY,
                                 headers={"authorization": f"Bearer {KEY}"}) as resp:
            if resp.status_code != 200:
                rec["why"] = f"http_{resp.status_code}"
            else:
                async for line in resp.aiter_lines():
                    if line.startswith('data: {"error"'):
                        rec["why"] = json.loads(line[6:])["error"].get("code") or "error"
                    elif line == "data: [DONE]":
                        rec["ok"] = not rec["why"]
    except httpx.HTTPError as exc:
        rec["why"] = type(exc).__name__
    rec["end"] = time.monotonic()
    out.append(rec)


async def _capacity(url: str, seconds: float = 5.0, concurrency: int = 16) -> float:
    done: list[dict[str, Any]] = []
    stop = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=60) as client:
        async def worker() -> None:
            while time.monotonic() < stop:
                await _one(client, url, done)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return float(sum(r["ok"] for r in done)) / seconds


async def _failover(stack: Stack, rate: float, duration: float,
                    kill_at: float) -> dict[str, Any]:
    rng = random.Random(8)
    out: list[dict[str, Any]] = []
    tasks: list[asyncio.Task[None]] = []
    victim = stack.backends[0].proc
    killed_at = in_flight = 0.0
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=2000)) as c:
        t0 = time.monotonic()
        next_at = 0.0
        killed = False
        while next_at < duration:
            now = time.monotonic() - t0
            if not killed and now >= kill_at:
                in_flight = await asyncio.to_thread(
                    stack.metric, 'sluice_gateway_slots_held{model="sluice-tiny#0"}')
                os.kill(victim.pid, signal.SIGKILL)
                killed_at, killed = time.monotonic(), True
                continue
            if now < next_at:
                await asyncio.sleep(min(next_at - now, 0.005))
                continue
            tasks.append(asyncio.ensure_future(_one(c, stack.url, out)))
            next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    victim.wait()
    failed = [r for r in out if not r["ok"]]
    kinds: dict[str, int] = {}
    for r in failed:
        kinds[r["why"]] = kinds.get(r["why"], 0) + 1
    before = [r for r in out if killed_at - 4 <= r["end"] < killed_at and r["ok"]]
    return {"out": out, "killed_at": killed_at, "in_flight": in_flight, "failed": failed,
            "kinds": kinds, "pre_goodput": len(before) / 4.0, "t0": t0}


def _recovery(res: dict[str, Any], survivor_rps: float) -> float | None:
    """Seconds from the kill to the first 1 s window with goodput ≥ 90 % of survivor_rps."""
    ends = sorted(r["end"] for r in res["out"] if r["ok"])
    k = float(res["killed_at"])
    step = 0.1
    t = k
    while ends and t + 1.0 <= ends[-1]:
        n = sum(1 for e in ends if t <= e < t + 1.0)
        if n >= 0.9 * survivor_rps:
            return round(t - k, 2)
        t += step
    return None


# ---- part 2: routing -----------------------------------------------------------------------
async def _routing(stack: Stack, seconds: float) -> dict[str, Any]:
    from loadtest.run import measure_workload
    from loadtest.stats import quantiles
    from loadtest.workload import load_workload

    w = load_workload(ROOT / "configs/workloads/prefix.yaml")
    w = w.model_copy(update={"duration_s": seconds, "warmup_s": 3.0, "cooldown_s": 3.0})
    before = stack.states()
    m = await measure_workload(w, stack.url, KEY, progress=False)
    after = stack.states()

    def delta(field: str) -> int:
        return sum(int(a.get(field, 0)) - int(b.get(field, 0))
                   for a, b in zip(after, before, strict=True))

    ttft = [x.ttft_ms for x in m.measured if x.ttft_ms is not None]
    q = quantiles(ttft)
    lookups = max(delta("prefix_cache_queries"), 1)
    return {"hit_rate": delta("prefix_cache_hits") / lookups,
            "tokens_saved": delta("prefill_tokens_saved")
            / max(delta("prefix_cache_query_tokens"), 1),
            "ttft_p50": q.get("p50"), "ttft_p95": q.get("p95"),
            "goodput_rps": m.report["goodput_rps"], "outcomes": m.report["outcomes"]}


def _part1(tmp: Path, args: argparse.Namespace) -> None:
    tmp.mkdir()
    stack = Stack(tmp, "least_load")
    try:
        cap = asyncio.run(_capacity(stack.url))
        rate = args.load * cap
        res = asyncio.run(_failover(stack, rate, args.duration, args.kill_at))
    finally:
        stack.close()
    survivor = min(res["pre_goodput"] or rate, cap / 2)
    rec = _recovery(res, survivor)
    print(f"pool capacity {cap:.1f} req/s (closed loop, 16 streams, max_tokens 32); "
          f"offered {rate:.1f} req/s ({args.load:.0%}), {len(res['out'])} requests")
    print(f"failed requests            {len(res['failed']):>6}   {res['kinds']}")
    print(f"in flight on the killed    {res['in_flight']:>6.0f}   (gateway slots_held "
          f"for that member just before SIGKILL)")
    print(f"recovery to {survivor:.1f} req/s  {rec if rec is not None else 'never':>6} s  "
          f"target <= cooldown {COOLDOWN_S} s + 2 s = {COOLDOWN_S + 2} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--kill-at", type=float, default=8.0)
    p.add_argument("--load", type=float, default=0.7, help="share of the pool's capacity")
    p.add_argument("--prefix-duration", type=float, default=30.0)
    p.add_argument("--prefix-kv-blocks", type=int, default=PREFIX_KV_BLOCKS,
                   help="KV blocks of each backend in the routing part (default "
                        f"{PREFIX_KV_BLOCKS}: prefix.yaml's 8 documents outgrow one cache)")
    p.add_argument("--skip-routing", action="store_true")
    p.add_argument("--skip-failover", action="store_true")
    args = p.parse_args(argv)
    from modelfiles.tiny_model import ensure_tiny_model

    ensure_tiny_model()
    with tempfile.TemporaryDirectory(prefix="sluice-failover-") as d:
        if not args.skip_failover:
            _part1(Path(d) / "failover", args)
        if args.skip_routing:
            return 0
        rows = {}
        for routing in ("least_load", "prefix"):
            sub = Path(d) / routing
            sub.mkdir()
            stack = Stack(sub, routing, args.prefix_kv_blocks)
            try:
                rows[routing] = asyncio.run(_routing(stack, args.prefix_duration))
            finally:
                stack.close()
        print(f"\nconfigs/workloads/prefix.yaml, {args.prefix_duration:.0f} s, 2 backends of "
              f"{args.prefix_kv_blocks} KV blocks (16 tokens) each")
        print(f"{'routing':<12}{'hit rate':>10}{'tokens saved':>14}{'TTFT p50 ms':>13}"
              f"{'TTFT p95 ms':>13}{'goodput':>9}")
        for name, r in rows.items():
            print(f"{name:<12}{r['hit_rate']:>10.1%}{r['tokens_saved']:>14.1%}"
                  f"{r['ttft_p50'] or 0:>13.1f}{r['ttft_p95'] or 0:>13.1f}"
                  f"{r['goodput_rps']:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
