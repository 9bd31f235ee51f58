"""`sluice loadtest WORKLOAD.yaml --target URL [--key KEY] --out DIR [--sweep]`.

Exit status: 0 the run completed (its verdict is in the report, not the status), 1 the
target could not be measured (unreachable, refused the probe), 2 a bad workload file.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from loadtest.run import Measurement, measure_workload
from loadtest.stats import Measured
from loadtest.workload import Workload, WorkloadError, load_workload


def request_rows(m: Measurement) -> list[dict[str, Any]]:
    """requests.jsonl: one row per arrival, in schedule order."""
    rows = []
    for rec, x in zip(m.result.records, m.measured, strict=True):
        p = rec.plan
        rows.append({
            "idx": p.idx, "t": round(p.t, 6), "class": p.cls, "tenant": p.tenant,
            "priority": p.priority, "measured": p.measured, "outcome": x.outcome,
            "status": rec.status, "dispatch_lag_ms": round((rec.dispatched - rec.scheduled)
                                                           * 1000, 3),
            "ttft_ms": x.ttft_ms, "tpot_ms": x.tpot_ms, "e2e_ms": x.e2e_ms,
            "queue_ms": x.queue_ms, "input_tokens": p.input_tokens,
            "prompt_tokens": x.prompt_tokens, "output_tokens": x.output_tokens,
            "cancelled": rec.cancelled or None, "error": rec.error or None})
    return rows


def by_class(m: Measurement) -> dict[str, list[Measured]]:
    out: dict[str, list[Measured]] = defaultdict(list)
    for rec, x in zip(m.result.records, m.measured, strict=True):
        if rec.plan.measured:
            out[rec.plan.cls].append(x)
    return dict(out)


def write_measurement(out: Path, w: Workload, m: Measurement) -> list[Path]:
    from loadtest.artifacts import write_all

    return write_all(out, m.report, m.details, by_class(m), request_rows(m), m.sweep,
                     w.slo_attainment_goal)


async def run_command(w: Workload, args: argparse.Namespace) -> Measurement:
    from loadtest.client import calibrate

    target = args.target.rstrip("/").removesuffix("/v1")
    cal = await calibrate(target, args.key, w)
    progress = not args.no_progress

    async def probe(wl: Workload, label: str) -> Measurement:
        return await measure_workload(wl, target, args.key, timeout_s=args.timeout,
                                      scrape=args.scrape, progress=progress, label=label,
                                      calibration=cal,
                                      scrape_key=os.environ.get(args.scrape_key_env) or None)

    if not args.sweep:
        return await probe(w, "")
    from loadtest.sweep import find_capacity

    capacity, m, curve = await find_capacity(w, probe, args.max_probes)
    m.report["capacity_rps"] = capacity
    m.sweep = curve
    if capacity is None:
        m.report["notes"].append(f"no probed rate reached the attainment goal "
                                 f"{w.slo_attainment_goal}")
    return m


def loadtest_main(args: argparse.Namespace) -> int:
    try:
        w = load_workload(args.workload)
    except WorkloadError as exc:
        print(f"sluice loadtest: {args.workload}: {exc}", file=sys.stderr)
        return 2
    import httpx

    try:
        m = asyncio.run(run_command(w, args))
    except (RuntimeError, OSError, httpx.HTTPError) as exc:
        print(f"sluice loadtest: cannot measure {args.target}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("sluice loadtest: interrupted", file=sys.stderr)
        return 130
    out = Path(args.out)
    write_measurement(out, w, m)
    r = m.report
    line = (f"offered {r['offered_rps']} rps, achieved {r['achieved_rps']}, goodput "
            f"{r['goodput_rps']}, joint SLO attainment {r['slo_attainment']}")
    if r["capacity_rps"] is not None or args.sweep:
        line += f", capacity {r['capacity_rps']} rps"
    print(line + (" (UNRELIABLE: " + "; ".join(r["notes"]) + ")" if r["unreliable"] else ""))
    print(f"report: {out / 'report.html'}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", help="workload YAML (see configs/workloads/)")
    p.add_argument("--target", required=True,
                   help="base URL of any OpenAI-compatible server (http://host:port[/v1])")
    p.add_argument("--key", default=None,
                   help="default API key (a class's key / key_env wins)")
    p.add_argument("--out", required=True, help="directory for the report and plots")
    p.add_argument("--sweep", action="store_true",
                   help="find the highest rate meeting slo_attainment_goal (several runs)")
    p.add_argument("--max-probes", type=int, default=8, help="runs the sweep may use")
    p.add_argument("--scrape", action="append", default=[], metavar="URL",
                   help="also scrape URL/metrics (e.g. the backend behind a gateway)")
    p.add_argument("--scrape-key-env", default="SLUICE_BACKEND_API_KEY", metavar="NAME",
                   help="the --scrape URLs get $NAME, where set, as their bearer key (a "
                        "bundled backend's /metrics needs its API key; default "
                        "SLUICE_BACKEND_API_KEY)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="per-request client timeout in s (a class's deadline_ms wins)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
