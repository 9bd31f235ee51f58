"""`python -m loadtest.accuracy`: how far the client's figures are from what the server did.

The client runs `measure_workload`, as `sluice loadtest` does, against the scripted server
(`loadtest/scripted_server.py`, its own process, every request answered: ``--plain``),
which logs when it read each request and wrote each chunk on CLOCK_MONOTONIC, the clock the
client stamps with. Per metric the error is the client's value minus the server's *logged*
one, never the nominal script: a server's sleeps overshoot on a busy machine, and that is
the target's latency, which the client must report, not an error of the client.

    client TTFT = first chunk's arrival - sent     server TTFT = first chunk write - read
    client TPOT = (last - first arrival)/(N - 1)   server TPOT = (last - first write)/(N - 1)
    client E2E  = [DONE] arrival - sent            server E2E  = [DONE] write - read
    chunk arrival = arrival of chunk k - its write (one value per chunk)
    request leg   = server read - client sent (the part of the TTFT/E2E error before the
                    server saw the request)

So TTFT error = request leg + first chunk's arrival delay. A chunk's arrival follows its
write (>= 0 by causality); the request leg may be a fraction of a ms below 0, since `sent`
is stamped when the client's write returned and the server may have read the bytes by
then. The size of each is the transport plus the wake-up lag of both processes. Also
printed: the client's dispatch lag p99 and CPU share, the inputs of its `unreliable`
verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest import scripted_server as script
from loadtest.run import Measurement, measure_workload
from loadtest.stats import describe
from loadtest.workload import Workload, parse_workload

RATES = (10.0, 50.0, 100.0)
DURATION_S, QUICK_DURATION_S = 10.0, 3.0
TIMEOUT_S = 30.0
NOMINAL_MS = {
    "ttft_ms": script.TTFT_MS,
    "tpot_ms": script.CHUNKS * script.GAP_MS / (script.OUTPUT_TOKENS - 1),
    "e2e_ms": script.TTFT_MS + script.CHUNKS * script.GAP_MS,
}
METRICS = ("ttft_ms", "tpot_ms", "e2e_ms", "chunk_arrival_ms", "request_leg_ms")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def scripted_server(log: Path) -> Iterator[str]:
    """The scripted server in its own process (no rejections); its base URL. Stopped by PID."""
    port = free_port()
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen([sys.executable, "-m", "loadtest.scripted_server", str(port),
                             str(log), "--plain"], cwd=root, env=env, stdout=subprocess.PIPE)
    try:
        if proc.stdout is None or proc.stdout.readline().strip() != b"ready":
            raise RuntimeError("the scripted server did not start")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def accuracy_workload(rate: float, duration_s: float, seed: int = 1) -> Workload:
    one = {"buckets": [{"input": 40, "output": script.OUTPUT_TOKENS}]}
    return parse_workload({
        "name": f"accuracy-{rate:g}rps", "seed": seed, "duration_s": duration_s,
        "model": "scripted", "arrival": {"process": "constant", "rate": rate},
        "classes": [{"name": "plain", "share": 1, "lengths": one}]})


@dataclass(slots=True)
class Pairs:
    """Per metric: the client's values, the server's logged values, their differences."""

    client: dict[str, list[float]]
    server: dict[str, list[float]]
    diff: dict[str, list[float]]

    @classmethod
    def empty(cls) -> Pairs:
        return cls({k: [] for k in METRICS}, {k: [] for k in METRICS},
                   {k: [] for k in METRICS})

    def add(self, name: str, client_ms: float, server_ms: float) -> None:
        self.client[name].append(client_ms)
        self.server[name].append(server_ms)
        self.diff[name].append(client_ms - server_ms)


def compare(m: Measurement, rows: dict[int, dict[str, Any]]) -> tuple[Pairs, int]:
    """Pair each completed answer with the server's row; (pairs, answers left unpaired)."""
    pairs, unpaired = Pairs.empty(), 0
    n = script.OUTPUT_TOKENS
    for rec, x in zip(m.result.records, m.measured, strict=True):
        row = rows.get(rec.plan.idx)
        if x.outcome not in ("success", "slo_miss"):
            continue
        if row is None or row["done_at"] is None or len(row["chunk_at"]) != len(rec.events):
            unpaired += 1
            continue
        read, writes = row["read_at"], row["chunk_at"]
        if x.ttft_ms is not None:
            pairs.add("ttft_ms", x.ttft_ms, (writes[0] - read) * 1000)
        if x.tpot_ms is not None:
            pairs.add("tpot_ms", x.tpot_ms, (writes[-1] - writes[0]) * 1000 / (n - 1))
        if x.e2e_ms is not None:
            pairs.add("e2e_ms", x.e2e_ms, (row["done_at"] - read) * 1000)
        for (arrived, _), wrote in zip(rec.events, writes, strict=True):
            pairs.add("chunk_arrival_ms", (arrived - wrote) * 1000, 0.0)
        pairs.add("request_leg_ms", (read - rec.sent) * 1000, 0.0)
    return pairs, unpaired


def read_rows(log: Path, offset: int) -> tuple[dict[int, dict[str, Any]], int]:
    """The rows logged past ``offset`` (idx -> row; probes, idx -1, left out), new offset."""
    with log.open("rb") as f:
        f.seek(offset)
        data = f.read()
    rows = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
    return {r["idx"]: r for r in rows if r["idx"] >= 0}, offset + len(data)


def summarize_run(rate: float, duration_s: float, m: Measurement, pairs: Pairs,
                  unpaired: int) -> dict[str, Any]:
    metrics: dict[str, Any] = {}
    for name in METRICS:
        entry: dict[str, Any] = {"n": len(pairs.diff[name]),
                                 "diff_ms": describe(pairs.diff[name])}
        if name in NOMINAL_MS:
            entry["client_p50"] = describe(pairs.client[name])["p50"]
            entry["server_p50"] = describe(pairs.server[name])["p50"]
            entry["nominal"] = round(NOMINAL_MS[name], 3)
        metrics[name] = entry
    return {"rate": rate, "duration_s": duration_s, "answers": len(pairs.diff["e2e_ms"]),
            "unpaired": unpaired, "outcomes": m.report["outcomes"],
            "achieved_rps": m.report["achieved_rps"], "client": m.details["client"],
            "unreliable": m.report["unreliable"], "notes": m.report["notes"],
            "metrics": metrics}


async def measure_rates(rates: list[float], duration_s: float, log: Path,
                        ) -> list[dict[str, Any]]:
    out = []
    log.touch()
    with scripted_server(log) as url:
        offset = 0
        for rate in rates:
            w = accuracy_workload(rate, duration_s)
            m = await measure_workload(w, url, "sk-plain", timeout_s=TIMEOUT_S, progress=False)
            rows, offset = read_rows(log, offset)
            pairs, unpaired = compare(m, rows)
            out.append(summarize_run(rate, duration_s, m, pairs, unpaired))
    return out


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def render(runs: list[dict[str, Any]]) -> str:
    lines = []
    for r in runs:
        c = r["client"]
        lines.append(f"\n{r['rate']:g} rps x {r['duration_s']:g} s: {r['answers']} answers "
                     f"paired ({r['unpaired']} unpaired); dispatch lag p99 "
                     f"{c['dispatch_lag_p99_ms']:.2f} ms, client CPU {c['cpu_share']:.0%}"
                     + (" UNRELIABLE" if r["unreliable"] else ""))
        lines.append(f"  {'metric':<17}{'client p50':>11}{'server p50':>11}{'nominal':>9}"
                     f"{'err p50':>9}{'err p99':>9}{'err max':>9}   (ms; err = client - server)")
        for name in METRICS:
            e, d = r["metrics"][name], r["metrics"][name]["diff_ms"]
            lines.append(f"  {name:<17}{_fmt(e.get('client_p50')):>11}"
                         f"{_fmt(e.get('server_p50')):>11}{_fmt(e.get('nominal')):>9}"
                         f"{_fmt(d['p50']):>9}{_fmt(d['p99']):>9}{_fmt(d['max']):>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.accuracy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES),
                    help="comma-separated constant rates, requests/s (default 10,50,100)")
    ap.add_argument("--duration", type=float, default=None,
                    help=f"seconds per rate (default {DURATION_S:g}; --quick {QUICK_DURATION_S:g})")
    ap.add_argument("--quick", action="store_true", help="shorter runs")
    ap.add_argument("--json", type=Path, default=None, help="write every figure here")
    ap.add_argument("--log", type=Path, default=None,
                    help="keep the server's JSON-lines log here (default: a temporary file)")
    args = ap.parse_args(argv)
    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    duration = args.duration or (QUICK_DURATION_S if args.quick else DURATION_S)
    with tempfile.TemporaryDirectory(prefix="sluice-accuracy-") as tmp:
        log = args.log or Path(tmp) / "server.jsonl"
        log.unlink(missing_ok=True)
        runs = asyncio.run(measure_rates(rates, duration, log))
    print(render(runs))
    result: dict[str, Any] = {"command": "python -m loadtest.accuracy " + " ".join(
        sys.argv[1:] if argv is None else argv), "runs": runs}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
