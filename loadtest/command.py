"""`sluice loadtest [WORKLOAD.yaml] --target URL [overrides] --out DIR [--sweep]`, and
`sluice loadtest compare RUN_A RUN_B --out DIR`.

Exit status: 0 the run completed (its verdict is in the report, not the status), 1 the
target could not be measured (unreachable, refused the probe), 2 a bad workload file or
flag, 130 interrupted (Ctrl-C or SIGTERM; the partial report is written when anything
was measured).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections import defaultdict
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from loadtest.client import PROBE_WAIT_S
from loadtest.run import Measurement, measure_workload
from loadtest.stats import Measured
from loadtest.urls import server_root
from loadtest.workload import Workload, WorkloadError

T = TypeVar("T")


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
            "cancelled": rec.cancelled or None, "error": rec.error or None,
            # per token and per chunk gap, for `sluice loadtest compare`
            "itl_ms": [round(v, 3) for v in x.itl_ms],
            "icl_ms": [round(v, 3) for v in x.icl_ms]})
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


def discover_model(target: str, key: str | None) -> str:
    """The target's first ``/v1/models`` entry (a run without a file or --model)."""
    import httpx

    headers = {"authorization": f"Bearer {key}"} if key else {}
    resp = httpx.get(target + "/v1/models", headers=headers, timeout=10.0)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data or not isinstance(data[0], dict) or not data[0].get("id"):
        raise RuntimeError("the target lists no model at /v1/models; pass --model")
    return str(data[0]["id"])


def _stop_on_signals(stop: asyncio.Event) -> None:
    """First Ctrl-C or SIGTERM: stop and report what finished. A second one: leave now."""
    loop = asyncio.get_running_loop()

    def first(sig: signal.Signals) -> None:
        print(f"sluice loadtest: {sig.name}: stopping, writing a partial report "
              f"({sig.name} again to abort)", file=sys.stderr, flush=True)
        stop.set()
        for s in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(s)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, first, sig)


async def _unless_stopped(work: Coroutine[Any, Any, T], stop: asyncio.Event) -> T | None:
    """``work``'s result, or None when ``stop`` is set first (``work`` is then cancelled)."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


async def run_command(w: Workload, args: argparse.Namespace, base: Path,
                      stop: asyncio.Event | None = None) -> Measurement | None:
    """The measured run(s) of one command; None when stopped before the first run."""
    from loadtest.client import calibrate

    target = args.target  # a server root already (_workload)
    stop = stop or asyncio.Event()
    _stop_on_signals(stop)
    got = await _unless_stopped(calibrate(target, args.key, w, wait_s=args.probe_wait), stop)
    if got is None:
        return None
    cal = got
    dataset = None
    if w.dataset is not None:
        from loadtest.dataset import prepare_dataset

        dataset = await _unless_stopped(prepare_dataset(
            w.dataset, api=w.api, seed=w.seed, base_url=target, key=args.key, model=w.model,
            base_dir=base), stop)
        if dataset is None:
            return None
    progress = not args.no_progress

    async def probe(wl: Workload, label: str) -> Measurement:
        return await measure_workload(wl, target, args.key, timeout_s=args.timeout,
                                      scrape=args.scrape, progress=progress, label=label,
                                      calibration=cal, dataset=dataset, stop=stop,
                                      scrape_key=os.environ.get(args.scrape_key_env) or None)

    if args.sweep_concurrency:
        from loadtest.concurrency import sweep_concurrency

        return await sweep_concurrency(w, probe, args.sweep_concurrency, Path(args.out), stop)
    if not args.sweep:
        return await probe(w, "")
    from loadtest.sweep import find_capacity

    capacity, m, curve = await find_capacity(w, probe, args.max_probes, stop)
    m.report["capacity_rps"] = capacity
    m.sweep = curve
    if capacity is None and not m.report.get("partial"):
        m.report["notes"].append(f"no probed rate reached the attainment goal "
                                 f"{w.slo_attainment_goal}")
    return m


def _workload(args: argparse.Namespace) -> tuple[Workload, Path] | int:
    import httpx

    from loadtest.arrivals import cap_requests
    from loadtest.overrides import build_workload

    if args.target is None:
        print("sluice loadtest: --target URL is required", file=sys.stderr)
        return 2
    args.target = server_root(args.target)
    if args.sweep and args.sweep_concurrency:
        print("sluice loadtest: --sweep (rates) and --sweep-concurrency exclude each other",
              file=sys.stderr)
        return 2
    if args.workload is None and args.model is None:
        try:
            args.model = discover_model(args.target, args.key)
        except (RuntimeError, ValueError, httpx.HTTPError) as exc:
            print(f"sluice loadtest: cannot list the models of {args.target} ({exc}); "
                  f"pass --model", file=sys.stderr)
            return 1
    try:
        w, base = build_workload(args)
        if args.sweep and w.requests is not None:
            raise WorkloadError("requests: --sweep scales the rate and so the number of "
                                "requests; give duration_s (--duration) instead")
        if args.sweep and w.concurrency is not None:
            raise WorkloadError("--sweep searches over rates: give an open-loop workload "
                                "(arrival or --rate), or use --sweep-concurrency")
        if args.sweep_concurrency and w.concurrency is None:
            w = w.model_copy(update={"concurrency": args.sweep_concurrency[0],
                                     "arrival": None})
        return cap_requests(w), base
    except (WorkloadError, ValueError) as exc:
        print(f"sluice loadtest: {args.workload or 'flags'}: {exc}", file=sys.stderr)
        return 2


def loadtest_main(args: argparse.Namespace) -> int:
    if args.workload == "compare":
        from loadtest.compare import compare_main

        if len(args.runs) != 2:
            print("sluice loadtest compare RUN_A RUN_B --out DIR: two run directories",
                  file=sys.stderr)
            return 2
        return compare_main(args.runs[0], args.runs[1], args.out or "compare-report",
                            args.confidence, args.resamples, args.seed or 0)
    if args.runs:
        print(f"sluice loadtest: unexpected arguments {args.runs}", file=sys.stderr)
        return 2
    args.out = args.out or "loadtest-report"
    built = _workload(args)
    if isinstance(built, int):
        return built
    w, base = built
    import httpx

    from loadtest.client import ProbeRefused
    from loadtest.dataset import DatasetError

    stop = asyncio.Event()
    try:
        m = asyncio.run(run_command(w, args, base, stop))
    except (DatasetError, WorkloadError) as exc:
        print(f"sluice loadtest: {exc}", file=sys.stderr)
        return 2
    except (ProbeRefused, RuntimeError, OSError, httpx.HTTPError) as exc:
        print(f"sluice loadtest: cannot measure {args.target}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("sluice loadtest: interrupted", file=sys.stderr)
        return 130
    if m is None:
        print("sluice loadtest: interrupted before the run started", file=sys.stderr)
        return 130
    out = Path(args.out)
    if not args.sweep_concurrency:
        write_measurement(out, w, m)
    r = m.report
    line = (f"offered {r['offered_rps']} rps, achieved {r['achieved_rps']}, goodput "
            f"{r['goodput_rps']}, joint SLO attainment {r['slo_attainment']}")
    if r["capacity_rps"] is not None or args.sweep:
        line += f", capacity {r['capacity_rps']} rps"
    if args.sweep_concurrency:
        line = "concurrency sweep: " + ", ".join(
            f"N={p['concurrency']} {p['achieved_rps']} rps" for p in m.sweep)
    print(line + (" (UNRELIABLE: " + "; ".join(r["notes"]) + ")" if r["unreliable"] else ""))
    print(f"report: {out / 'report.html'}")
    if r.get("partial"):
        print("sluice loadtest: interrupted; the report is partial", file=sys.stderr)
        return 130
    return 0


def _concurrencies(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("concurrencies must be >= 1")
    return sorted(set(values))


def add_arguments(p: argparse.ArgumentParser) -> None:
    from loadtest.overrides import add_override_arguments

    p.add_argument("workload", nargs="?",
                   help="workload YAML (see configs/workloads/); optional with --rate or "
                        "--concurrency; `compare` compares two runs")
    p.add_argument("runs", nargs="*", help=argparse.SUPPRESS)
    p.add_argument("--target",
                   help="base URL of any OpenAI-compatible server (http://host:port[/v1])")
    p.add_argument("--key", default=None,
                   help="default API key (a class's key / key_env wins)")
    p.add_argument("--out", default=None,
                   help="directory for the report and plots (default loadtest-report; "
                        "compare: compare-report)")
    p.add_argument("--sweep", action="store_true",
                   help="find the highest rate meeting slo_attainment_goal (several runs)")
    p.add_argument("--max-probes", type=int, default=8, help="runs the sweep may use")
    p.add_argument("--sweep-concurrency", type=_concurrencies, metavar="N,N,...",
                   help="closed loop at each concurrency; plots throughput against latency")
    p.add_argument("--scrape", action="append", default=[], metavar="URL",
                   help="also scrape URL/metrics (e.g. the backend behind a gateway)")
    p.add_argument("--scrape-key-env", default="SLUICE_BACKEND_API_KEY", metavar="NAME",
                   help="the --scrape URLs get $NAME, where set, as their bearer key (a "
                        "bundled backend's /metrics needs its API key; default "
                        "SLUICE_BACKEND_API_KEY)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="per-request client timeout in s (a class's deadline_ms wins)")
    p.add_argument("--probe-wait", type=float, default=PROBE_WAIT_S, metavar="S",
                   help="how long the start-up probes may wait on 429/503 Retry-After "
                        "(default 30 s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_override_arguments(p)
    c = p.add_argument_group("compare (sluice loadtest compare RUN_A RUN_B --out DIR)")
    c.add_argument("--confidence", type=float, default=0.95,
                   help="confidence of the bootstrap intervals (default 0.95)")
    c.add_argument("--resamples", type=int, default=2000,
                   help="bootstrap resamples (default 2000)")
