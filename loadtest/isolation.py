"""Tenant isolation under hostile load, measured side by side in one run.

    python -m loadtest.isolation [--quick] [--json FILE]

Starts one `sluice up` (gateway + bundled tiny backend) with two tenants: ``attacker``
(prompts capped at 8192 tokens) and ``victim``. The victim sends small chat requests open
loop at a fixed rate throughout; the run has four phases of equal length:

    baseline     the victim alone
    big bodies   the attacker sends 3 concurrent ~3.8 MB chat bodies (under the 4 MiB body
                 limit, far over its prompt cap) once a second, each refused; the rounds
                 alternate two shapes: one message of ~760k words, and ~120k empty messages
                 (whose size is the chat template's markup, not text)
    after        the victim alone again; the gateway's RSS is read at the end
    slowloris    200 connections hold a request head open, one byte a second (re-opened
                 when the server cuts them)

and prints, against the issue's targets: the victim's p99 added while the big bodies are
refused (≤ 50 ms), the slowest refusal (≤ 200 ms), the gateway's RSS after the big bodies
against before them (within 50 MiB; its parse workers' RSS is printed beside it), and the
victim's p50 with the slowloris connections open over its baseline p50 (≤ 1.2×). The load tool talks HTTP only: nothing here imports
the gateway. Nothing is asserted; the figures are printed (and written with --json).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest.targets import Service, free_port, hash_key, wait_ready

REPO_ROOT = Path(__file__).resolve().parents[1]
ATTACKER, VICTIM = "sk-iso-attacker", "sk-iso-victim"
MODEL = "sluice-tiny"
BIG_WORDS = 760_000  # "word " × this: ~3.8 MB of text, under the 4 MiB body limit
MANY_MESSAGES = 120_000  # empty user messages: ~3.9 MB of JSON, almost no text
SHAPES = ("one message", "many messages")
SLOW_CONNECTIONS = 200


@dataclass(slots=True)
class Phase:
    name: str
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0

    def pct(self, q: float) -> float:
        xs = sorted(self.latencies_ms)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def tenants_yaml() -> str:
    return f"""\
tenants:
  - id: attacker
    keys: ["{hash_key(ATTACKER)}"]
    caps: {{max_prompt_tokens: 8192}}
  - id: victim
    keys: ["{hash_key(VICTIM)}"]
"""


def start(workdir: Path) -> tuple[Service, str]:
    tenants = workdir / "tenants.yaml"
    tenants.write_text(tenants_yaml())
    port = free_port()
    log = workdir / "up.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sluice.cli", "up", "--port", str(port), "--backend-port",
             str(free_port()), "--tenants", str(tenants), "--log-level", "warning"],
            cwd=REPO_ROOT, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    service = Service("sluice-up", proc, port, log)
    try:
        wait_ready(service, "/readyz", 180)
    except BaseException:
        service.stop()
        raise
    return service, f"http://127.0.0.1:{port}"


def rss_mib(pid: int) -> float:
    """Resident memory of the gateway process (`sluice up` runs the gateway itself)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def worker_pids(pid: int) -> list[int]:
    """The gateway's parse-pool processes: its children started by multiprocessing."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(proc.name))
    return found


def workers_rss_mib(pid: int) -> float:
    return sum(rss_mib(p) for p in worker_pids(pid))


SMALL = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


async def victim(client: httpx.AsyncClient, url: str, phase: Phase, rate: float,
                 seconds: float) -> None:
    """Open loop: one small request every 1/rate s, each timed alone."""
    async def one() -> None:
        t0 = time.perf_counter()
        try:
            r = await client.post(url + "/v1/chat/completions", json=SMALL,
                                  headers={"authorization": f"Bearer {VICTIM}"})
            ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            phase.latencies_ms.append((time.perf_counter() - t0) * 1000)
        else:
            phase.errors += 1

    tasks = []
    start = time.perf_counter()
    n = int(rate * seconds)
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one()))
    await asyncio.gather(*tasks)


def attack_in_child(url: str, seconds: float,
                    shapes: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
    """``big_bodies`` in a child process (spawned: no state shared with this one)."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_attack, (url, seconds, shapes))


def _attack(url: str, seconds: float,
            shapes: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
    refusals: dict[str, list[tuple[int, float]]] = {}
    asyncio.run(big_bodies(url, seconds, refusals, shapes))
    return refusals


def big_shapes() -> dict[str, bytes]:
    """The attacker's two near-limit bodies: one huge message, or very many tiny ones."""
    one = {"model": MODEL, "messages": [{"role": "user", "content": "word " * BIG_WORDS}]}
    many = {"model": MODEL,
            "messages": [{"role": "user", "content": ""}] * MANY_MESSAGES}
    return {"one message": json.dumps(one).encode(), "many messages": json.dumps(many).encode()}


async def big_bodies(url: str, seconds: float, refusals: dict[str, list[tuple[int, float]]],
                     names: tuple[str, ...] = SHAPES) -> None:
    """Three concurrent near-limit bodies at the start of every second of the phase, the
    shape alternating round by round."""
    shapes = [(n, b) for n, b in big_shapes().items() if n in names]
    headers = {"authorization": f"Bearer {ATTACKER}", "content-type": "application/json"}
    end = time.perf_counter() + seconds
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(shape: str, body: bytes) -> None:
            t0 = time.perf_counter()
            r = await client.post(url + "/v1/chat/completions", content=body, headers=headers)
            refusals.setdefault(shape, []).append((r.status_code,
                                                   (time.perf_counter() - t0) * 1000))

        n = 0
        while time.perf_counter() < end:
            round_end = time.perf_counter() + 1.0
            shape, body = shapes[n % len(shapes)]
            n += 1
            await asyncio.gather(one(shape, body), one(shape, body), one(shape, body))
            await asyncio.sleep(max(0.0, min(round_end, end) - time.perf_counter()))


async def slowloris(port: int, stop: asyncio.Event, opened: list[int]) -> None:
    """Keep SLOW_CONNECTIONS request heads open, a byte a second each."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"

    async def hold() -> None:
        while not stop.is_set():
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.5)
                continue
            opened[0] += 1
            try:
                for byte in head * 100:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 1.0)
                    if stop.is_set():
                        break
            except OSError:
                pass  # cut by the server: open another
            finally:
                writer.close()

    await asyncio.gather(*(hold() for _ in range(SLOW_CONNECTIONS)))


async def run(url: str, pid: int, seconds: float, rate: float,
              shapes: tuple[str, ...] = SHAPES) -> dict[str, Any]:
    phases = {n: Phase(n) for n in ("baseline", "big bodies", "after", "slowloris")}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        await victim(client, url, Phase("warm-up"), rate, 2.0)
        await victim(client, url, phases["baseline"], rate, seconds)
        rss_before, workers_before = rss_mib(pid), workers_rss_mib(pid)
        # the attacker runs in a process of its own: writing 12 MB a second from this
        # loop would delay the victim's client, not the gateway
        attack = asyncio.ensure_future(asyncio.to_thread(attack_in_child, url, seconds, shapes))
        await victim(client, url, phases["big bodies"], rate, seconds)
        refusals = await attack
        await victim(client, url, phases["after"], rate, seconds)
        rss_after, workers_after = rss_mib(pid), workers_rss_mib(pid)
        stop, opened = asyncio.Event(), [0]
        loris = asyncio.ensure_future(slowloris(int(url.rsplit(":", 1)[1]), stop, opened))
        await asyncio.sleep(3.0)  # let them connect
        await victim(client, url, phases["slowloris"], rate, seconds)
        stop.set()
        await loris
    base = phases["baseline"]
    return {
        "phases": {n: {"requests": len(p.latencies_ms), "errors": p.errors,
                       "p50_ms": p.pct(0.5), "p99_ms": p.pct(0.99)}
                   for n, p in phases.items()},
        "refusals": {shape: {"count": len(rs), "statuses": sorted({s for s, _ in rs}),
                             "max_ms": max(ms for _, ms in rs),
                             "median_ms": statistics.median(ms for _, ms in rs)}
                     for shape, rs in refusals.items()},
        "added_p99_ms": phases["big bodies"].pct(0.99) - base.pct(0.99),
        "rss_mib": {"before": rss_before, "after": rss_after, "delta": rss_after - rss_before},
        "parse_workers_rss_mib": {"before": workers_before, "after": workers_after},
        "slowloris_p50_ratio": phases["slowloris"].pct(0.5) / base.pct(0.5),
        "slowloris_connections_opened": opened[0],
    }


def report(r: dict[str, Any]) -> list[tuple[str, float, float, bool]]:
    refs = r["refusals"]
    slowest = max((ref["max_ms"] for ref in refs.values()), default=float("nan"))
    refused = all(400 <= s < 500 for ref in refs.values() for s in ref["statuses"])
    checks = [
        ("victim p99 added while big bodies are refused (ms, <= 50)", r["added_p99_ms"], 50.0,
         r["added_p99_ms"] <= 50),
        ("slowest refusal of a big body, either shape (ms, <= 200)", slowest, 200.0,
         slowest <= 200 and refused),
        ("gateway RSS after - before (MiB, <= 50)", r["rss_mib"]["delta"], 50.0,
         r["rss_mib"]["delta"] <= 50),
        ("victim p50 with 200 slowloris / baseline (<= 1.2)", r["slowloris_p50_ratio"], 1.2,
         r["slowloris_p50_ratio"] <= 1.2),
    ]
    print(f"{'phase':<12} {'requests':>8} {'errors':>6} {'p50 ms':>8} {'p99 ms':>8}")
    for name, p in r["phases"].items():
        print(f"{name:<12} {p['requests']:>8} {p['errors']:>6} {p['p50_ms']:>8.1f} "
              f"{p['p99_ms']:>8.1f}")
    for shape, ref in refs.items():
        print(f"big bodies, {shape}: {ref['count']} answered (statuses {ref['statuses']}), "
              f"median {ref['median_ms']:.1f} ms, slowest {ref['max_ms']:.1f} ms")
    print(f"gateway RSS: {r['rss_mib']['before']:.1f} MiB before the big bodies, "
          f"{r['rss_mib']['after']:.1f} MiB after")
    workers = r.get("parse_workers_rss_mib")
    if workers:
        print(f"its parse workers' RSS (together): {workers['before']:.1f} MiB before, "
              f"{workers['after']:.1f} MiB after")
    for name, value, goal, ok in checks:
        print(f"  {name:<60} {value:>8.2f}  {'PASS' if ok else 'MISS'}")
    return checks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.isolation", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 s phases instead of 10 s")
    ap.add_argument("--rate", type=float, default=20.0, help="victim requests per second")
    ap.add_argument("--shape", choices=["both", *SHAPES], default="both",
                    help="the attacker's bodies (default: rounds of each in turn)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    if args.rate <= 0:
        ap.error("--rate must be > 0")
    seconds = 4.0 if args.quick else 10.0
    with tempfile.TemporaryDirectory(prefix="sluice-isolation-") as tmp:
        service, url = start(Path(tmp))
        try:
            shapes = SHAPES if args.shape == "both" else (args.shape,)
            result = asyncio.run(run(url, service.proc.pid, seconds, args.rate, shapes))
        finally:
            service.stop()
    checks = report(result)
    result["checks"] = [asdict_check(c) for c in checks]
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def asdict_check(check: tuple[str, float, float, bool]) -> dict[str, Any]:
    name, value, goal, ok = check
    return {"name": name, "value": value, "goal": goal, "pass": ok}


if __name__ == "__main__":
    sys.exit(main())
