"""This checkout's gateway against another checkout's, side by side in one run.

    python -m loadtest.versus --baseline DIR [--quick] [--json FILE]

``DIR`` is another checkout of Sluice (``git worktree add /tmp/base <commit>``); its gateway
runs from its sources (``PYTHONPATH=DIR`` with ``PYTHONSAFEPATH=1``, so that the working
directory, this checkout, does not come first on ``sys.path``) on this environment's
packages; the bench checks which sources each side imports before it measures. Both gateways get
the same config in front of the same `sluice fake-upstream`, tracing off. Then, as
``loadtest.tracing_cost`` does: (a) at a fixed rate both sustain, each one's CPU per
request and latency, their segments interleaved; (c) saturation throughput, closed loop,
the two alternating in short segments over many rounds, and the median per-round ratio
this / baseline. Used for a change whose cost is spread thin over the hot path (the metrics
library, issue #22), where only an end-to-end figure says what it costs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtest import targets as procs
from loadtest.load_client import Pool
from loadtest.measure import Target, chat_request, interleaved, warm_up
from loadtest.overhead import CHUNKS, Plan, _table
from loadtest.report import run_bench, say, verdict, write_report
from loadtest.tracing_cost import SATURATION_CLIENTS, saturation


def sources(env: dict[str, str]) -> Path:
    """The checkout whose ``gateway`` package a gateway started with ``env`` imports (run
    as the bench runs it: from this checkout's directory)."""
    code = "import gateway, pathlib; print(pathlib.Path(gateway.__file__).resolve().parents[1])"
    out = subprocess.run([sys.executable, "-c", code],
                         cwd=procs.REPO_ROOT, env={**os.environ, **env}, check=True,
                         capture_output=True, text=True, timeout=60)
    return Path(out.stdout.strip())


async def _bench(baseline: Path, plan: Plan, workdir: Path,
                 stack: contextlib.ExitStack) -> dict[str, Any]:
    base_env = {"PYTHONPATH": str(baseline), "PYTHONSAFEPATH": "1"}
    if sources(base_env) != baseline.resolve():
        raise RuntimeError(f"the baseline gateway would not run from {baseline}")
    if sources({"PYTHONPATH": str(procs.REPO_ROOT)}) != procs.REPO_ROOT.resolve():
        raise RuntimeError(f"this gateway would not run from {procs.REPO_ROOT}")
    up = procs.start_fake_upstream(workdir, CHUNKS)
    stack.callback(up.stop)
    off = {"OTEL_TRACES_EXPORTER": "none"}
    base = procs.start_gateway(workdir, up.port, name="baseline", env={**off, **base_env})
    stack.callback(base.stop)
    this = procs.start_gateway(workdir, up.port, name="this", env=off)
    stack.callback(this.stop)
    direct = Target("direct", Pool("127.0.0.1", up.port, chat_request(up.port, None)))
    gateways = [Target(name, Pool("127.0.0.1", svc.port, chat_request(svc.port, procs.BENCH_KEY)),
                       svc.cpu_seconds) for name, svc in (("baseline", base), ("this", this))]
    report: dict[str, Any] = {"plan": asdict(plan), "baseline": str(baseline)}
    try:
        await warm_up([direct, *gateways])
        stats = await interleaved([direct, *gateways], plan.rate, plan.seconds,
                                  plan.segment_s, CHUNKS)
        report["at_rate"] = {k: asdict(v) for k, v in stats.items()}
        _table(f"(a) {plan.rate:g} requests/s streamed chat ({CHUNKS} chunks), "
               f"{plan.seconds:g} s per target", stats, "direct")
        say(f"\n(c) saturation throughput: {SATURATION_CLIENTS} closed-loop clients, "
            f"{plan.saturation_rounds} rounds of {plan.saturation_segment_s:g} s per gateway")
        report["saturation"] = sat = await saturation(gateways, plan.saturation_rounds,
                                                      plan.saturation_segment_s)
    finally:
        for target in [direct, *gateways]:
            await target.pool.close()
    ratio = sat["median_ratio"]["this"]
    cpu = {g.name: stats[g.name].cpu_us_per_request for g in gateways}
    say(f"\nCPU per request at {plan.rate:g}/s: " + ", ".join(
        f"{n} {v:.0f} µs" for n, v in cpu.items() if v is not None))
    rounds = sat["ratios"]["this"]
    say(f"saturation throughput, this / baseline per round: median {ratio:.3f}, "
        f"{min(rounds):.3f}-{max(rounds):.3f}")
    report["cpu_us_per_request"] = cpu
    report["throughput_ratio"] = round(ratio, 3)
    report["verdicts"] = [verdict("saturation throughput, this / baseline", ratio, None)]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.versus",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True,
                        help="another checkout of Sluice (its gateway runs from its sources)")
    parser.add_argument("--quick", action="store_true", help="short run (~1 minute)")
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    parser.add_argument("--rate", type=float, default=200.0,
                        help="rate of part (a), requests/s (default 200)")
    args = parser.parse_args(argv)
    if not (args.baseline / "gateway" / "app.py").is_file():
        parser.error(f"{args.baseline} is not a Sluice checkout (no gateway/app.py)")
    plan = Plan.quick(args.rate) if args.quick else Plan(rate=args.rate, saturation_rounds=12)
    status, report = run_bench("versus", lambda tmp, stack: _bench(
        args.baseline.resolve(), plan, tmp, stack))
    if status:
        return status
    write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
