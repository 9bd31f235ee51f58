"""`make capacity`: goodput of the bundled backend behind the gateway vs the same backend hit
directly, at 1x and 2x the capacity the sweep finds (python -m loadtest.capacity).

One `sluice up` (gateway + bundled tiny backend) serves both targets: the gateway's URL, and
its backend's URL with no admission in front (reached with the backend's API key, which
this run makes and hands to `sluice up`). Runs never overlap. The workload is
configs/workloads/capacity.yaml (short Q&A, long context, long generation; two tenants;
two priorities; gamma bursts; 10% cancellations).

Targets (issue #7): at 2x, gateway goodput >= 90% of its goodput at 1x, and >= 3x the
direct backend's goodput at 2x; the interactive class's P99 TTFT within its SLO.
Every figure is printed side by side from this one run; nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from loadtest.client import calibrate
from loadtest.command import write_measurement
from loadtest.run import Measurement, measure_workload
from loadtest.sweep import find_capacity
from loadtest.targets import Service, TargetError, free_port, hash_key, wait_ready
from loadtest.workload import Workload, load_workload

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = REPO_ROOT / "configs" / "workloads" / "capacity.yaml"
KEYS = {"SLUICE_CAP_KEY_ALPHA": "sk-cap-alpha", "SLUICE_CAP_KEY_BETA": "sk-cap-beta"}
BACKEND_KEY_ENV = "SLUICE_BACKEND_API_KEY"  # `sluice up` gives the backend this key
INTERACTIVE = "interactive"
MODEL = "sluice-small"
WARMUP_S = 15.0


def tenants_yaml() -> str:
    """Two tenants whose quotas never bind: admission here is about capacity, not quota."""
    a, b = hash_key(KEYS["SLUICE_CAP_KEY_ALPHA"]), hash_key(KEYS["SLUICE_CAP_KEY_BETA"])
    quotas = ("{tokens_per_minute: 100000000, requests_per_minute: 1000000, "
              "max_concurrency: 1000, max_queued: 1000}")
    return f"""\
tenants:
  - id: alpha
    keys: ["{a}"]
    priority: {{min: 0, max: 10, default: 5}}
    quotas: {quotas}
    weight: 2
  - id: beta
    keys: ["{b}"]
    priority: {{min: 5, max: 10, default: 8}}
    quotas: {quotas}
"""


def verdicts(runs: dict[str, Measurement], slo_ttft: float | None) -> list[dict[str, Any]]:
    g1, g2 = runs["gateway_1x"].report["goodput_rps"], runs["gateway_2x"].report["goodput_rps"]
    d2 = runs["direct_2x"].report["goodput_rps"]
    p99 = runs["gateway_2x"].report["classes"][INTERACTIVE]["ttft_ms"]["p99"]
    keep = g2 / g1 if g1 else None
    vs_direct = g2 / d2 if d2 else float("inf") if g2 else None
    return [
        {"target": "gateway goodput 2x / 1x >= 0.90", "value": keep,
         "pass": keep is not None and keep >= 0.9},
        {"target": "gateway goodput / direct goodput at 2x >= 3", "value": vs_direct,
         "pass": vs_direct is not None and vs_direct >= 3},
        {"target": f"interactive P99 TTFT at 2x (gateway) <= SLO {slo_ttft} ms", "value": p99,
         "pass": p99 is not None and slo_ttft is not None and p99 <= slo_ttft},
    ]


def print_table(runs: dict[str, Measurement], capacity: float | None,
                checks: list[dict[str, Any]]) -> None:
    print(f"\ncapacity (sweep, gateway): {capacity} req/s at joint SLO attainment >= goal\n")
    head = ["run", "offered", "achieved", "goodput", "attain", "429", "503", "timeout",
            "cancel", "int. p99 TTFT", "unreliable"]
    print("  ".join(f"{h:>13}" for h in head))
    for name, m in runs.items():
        r = m.report
        o = r["outcomes"]
        cells = [name, r["offered_rps"], r["achieved_rps"], r["goodput_rps"],
                 r["slo_attainment"], o["rejected_429"], o["rejected_503"], o["timeout"],
                 o["cancelled"], r["classes"][INTERACTIVE]["ttft_ms"]["p99"], r["unreliable"]]
        print("  ".join(f"{c:>13.4g}" if isinstance(c, float) else f"{c!s:>13}"
                        for c in cells))
    print()
    for c in checks:
        value = "-" if c["value"] is None else f"{c['value']:.3g}"
        print(f"  {c['target']:<58} {value:>8}  {'PASS' if c['pass'] else 'MISS'}")


def keyed(w: Workload, key: str) -> Workload:
    """``w`` with every class sending ``key``: the backend's API key, for the direct runs
    (the backend checks that key alone; tenants are the gateway's)."""
    return w.model_copy(update={"classes": [c.model_copy(update={"key": key, "key_env": None})
                                            for c in w.classes]})


async def experiment(gw: str, backend: str, out: Path, probes: int,
                     backend_key: str) -> dict[str, Any]:
    w = load_workload(WORKLOAD).model_copy(update={"model": MODEL})
    base = w.mean_rate()
    cal_gw = await calibrate(gw, None, w)
    cal_direct = await calibrate(backend, None, keyed(w, backend_key))

    async def probe(wl: Workload, label: str) -> Measurement:
        return await measure_workload(wl, gw, None, scrape=[backend], label=label,
                                      calibration=cal_gw, scrape_key=backend_key)

    # A first, discarded run at the configured rate: the first minutes of a fresh backend
    # (allocator, first long prompts) are slower, and would fail the first probe.
    warm = w.model_copy(update={"duration_s": WARMUP_S, "warmup_s": 0.0, "cooldown_s": 0.0})
    await measure_workload(warm, gw, None, label="warm-up (discarded)", calibration=cal_gw)
    # Probes run as long as the measured runs: overload builds up over time, and a shorter
    # probe would call a rate sustainable that a longer run is not.
    capacity, _, curve = await find_capacity(w, probe, probes)
    # 1x is the configured rate of the probe that set the capacity (the offered rate it
    # realised in its window differs a little: gamma bursts over 23 s)
    rate = next((p["rate"] for p in curve if p["offered_rps"] == capacity), base)
    runs: dict[str, Measurement] = {}
    for name, url, cal, factor in (("gateway_1x", gw, cal_gw, 1.0),
                                   ("gateway_2x", gw, cal_gw, 2.0),
                                   ("direct_1x", backend, cal_direct, 1.0),
                                   ("direct_2x", backend, cal_direct, 2.0)):
        wl = w.scaled(rate * factor / base)
        m = await measure_workload(wl if url == gw else keyed(wl, backend_key), url, None,
                                   scrape=[backend], label=name, calibration=cal,
                                   scrape_key=backend_key)
        m.report["capacity_rps"] = capacity
        m.sweep = curve if name.startswith("gateway") else []
        write_measurement(out / name, w, m)
        runs[name] = m
    slo = w.class_named(INTERACTIVE).slo.ttft_ms
    checks = verdicts(runs, slo)
    print_table(runs, capacity, checks)
    summary = {"capacity_rps": capacity, "sweep": curve, "checks": checks,
               "runs": {k: v.report for k, v in runs.items()}}
    (out / "capacity.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def write_small_model(out: Path) -> Path:
    """`sluice tiny-model --size small`: the tiny model's tokenizer with ~10M parameters
    (loadtest reaches the rest of Sluice through its command line and HTTP only)."""
    subprocess.run([sys.executable, "-m", "sluice.cli", "tiny-model", "--size", "small",
                    "--out", str(out)], check=True, cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    return out


def start_up(workdir: Path, tenants: Path, model: Path, max_seqs: int, backend_key: str,
             reserve: float = 0.0) -> tuple[Service, str, str]:
    """`sluice up` in its own process group on free ports: (service, gateway, backend).

    The backend serves the `small` model (the tiny model is so cheap per step that the HTTP
    layers, on the same two cores, would saturate first and the experiment would measure
    them instead of admission in front of a model at its limit), with one torch thread so
    that the gateway and this client keep a core. ``max_seqs`` caps the backend's batch;
    the gateway reads it from /v1/state and admits against it, the direct runs meet the
    backend's own waiting queue behind it."""
    port, backend_port = free_port(), free_port()
    log = workdir / "up.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sluice.cli", "up", "--port", str(port), "--backend-port",
             str(backend_port), "--tenants", str(tenants), "--log-level", "warning",
             "--model", str(model), "--served-model-name", MODEL,
             "--max-num-seqs", str(max_seqs)],
            cwd=REPO_ROOT, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1",
                 BACKEND_KEY_ENV: backend_key,
                 # the gateway keeps this share of the backend for interactive (priority 0)
                 "SLUICE_QUEUE__RESERVE_SHARE": str(reserve),
                 "SLUICE_QUEUE__RESERVE_PRIORITY": "0"})
    service = Service("sluice-up", proc, port, log)
    try:
        wait_ready(service, "/healthz", 180)
    except BaseException:
        service.stop()
        raise
    return service, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{backend_port}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.capacity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="capacity-report", help="directory for the reports")
    ap.add_argument("--probes", type=int, default=4, help="sweep runs (default 4)")
    ap.add_argument("--max-num-seqs", type=int, default=8,
                    help="the backend's batch limit (default 8; see start_up)")
    ap.add_argument("--reserve", type=float, default=0.25,
                    help="gateway queue.reserve_share kept for the interactive class "
                         "(priority 0); default 0.25, 0 turns it off")
    args = ap.parse_args(argv)
    if not 0 <= args.reserve < 1:
        ap.error("--reserve must be in [0, 1)")
    os.environ.update(KEYS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sluice-capacity-") as tmp:
        tenants = Path(tmp) / "tenants.yaml"
        tenants.write_text(tenants_yaml())
        try:
            model = write_small_model(Path(tmp) / "small-model")
            backend_key = secrets.token_urlsafe(24)
            up, gw, backend = start_up(Path(tmp), tenants, model, args.max_num_seqs,
                                       backend_key, args.reserve)
        except TargetError as exc:
            print(f"capacity: sluice up did not start: {exc}", file=sys.stderr)
            return 1
        try:
            print(f"sluice up: gateway {gw}, backend {backend}", flush=True)
            asyncio.run(experiment(gw, backend, out, args.probes, backend_key))
        except KeyboardInterrupt:
            print("capacity: interrupted", file=sys.stderr)
            return 130
        finally:
            up.stop()
    print(f"reports: {out}/<run>/report.html, summary: {out}/capacity.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
