"""What tracing costs the gateway, with the stock OpenTelemetry SDK, side by side in one run.

    python -m loadtest.tracing_cost [--quick] [--json FILE]

Starts `sluice fake-upstream`, an OTLP/HTTP receiver (``python -m telemetry.bench.otlp_sink
--no-decode``, its own process: in the load client's process its reads would stall the
client's clock), and four `sluice gateway` processes with the same config in front of the
same upstream:

* ``untraced``: ``OTEL_TRACES_EXPORTER=none``;
* ``sdk-10%``: the Compose default, ``parentbased_traceidratio`` 0.1, the SDK's
  ``BatchSpanProcessor`` and OTLP/HTTP exporter to the receiver;
* ``sdk-100%``: the same, ``always_on``;
* ``null-10%``: 10 % sampling into an exporter that drops every batch unread (a plugin,
  chosen by ``OTEL_TRACES_EXPORTER`` through the SDK's entry points). No exporter can cost
  less, so ``null-10%`` ÷ ``sdk-10%`` bounds what any faster exporter (a C encoder) could
  win at the Compose default.

Then, interleaving the gateways in short segments as the overhead bench does
(docs/overhead.md): (a) at a fixed rate all sustain, each gateway's CPU time per request
and its latency; (c) each gateway's saturation throughput: closed loop, a fixed number of
clients each sending its next request when its last one ends, so that the gateway is the
bottleneck, the gateways alternating in short segments over many rounds; the median of the
per-round ratios to ``untraced``.

Targets (issue #22): ``sdk-10%`` ÷ ``untraced`` >= 0.9; a faster exporter (the C encoder)
stays only if it shows >= 1.05 over the stock one at 10 %, and ``null-10%`` ÷ ``sdk-10%``
is the ceiling of that (docs/overhead.md). Each traced
gateway's /metrics is read afterwards (``sluice_telemetry_spans_total``): spans exported,
failed and dropped.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtest import targets as procs
from loadtest.load_client import Pool, check_stream, closed_loop
from loadtest.measure import Target, chat_request, interleaved, warm_up
from loadtest.overhead import CHUNKS, Plan, _table
from loadtest.report import run_bench, say, verdict, write_report

GOAL_RATE_RATIO = 0.9
NATIVE_WORTH = 1.05  # what a faster exporter must win at 10 % to be kept
SATURATION_CLIENTS = 8

NULL_EXPORTER = """
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


class NullExporter(SpanExporter):
    def export(self, spans):
        return SpanExportResult.SUCCESS
"""


def null_exporter_plugin(workdir: Path) -> Path:
    """A directory to put on PYTHONPATH: an installed distribution whose trace exporter
    ``null`` (entry point group ``opentelemetry_traces_exporter``) drops every batch."""
    return procs.write_plugin(workdir / "null-exporter", "sluice_null_exporter", NULL_EXPORTER,
                        {"null": "NullExporter"})


async def saturation(targets: list[Target], rounds: int, segment_s: float,
                     clients: int = SATURATION_CLIENTS) -> dict[str, Any]:
    """Closed-loop throughput of each target (successes per second), alternating targets
    segment by segment (the order flips every round), and the median ratio of each target
    to the first one per round: a drift in the machine's speed hits both of a round alike."""
    for t in targets:  # warm-up, discarded
        await closed_loop(t.pool, clients, min(1.0, segment_s))
    rates: dict[str, list[float]] = {t.name: [] for t in targets}
    errors: dict[str, Counter[str]] = {t.name: Counter() for t in targets}
    for r in range(rounds):
        for t in (targets if r % 2 == 0 else list(reversed(targets))):
            samples, span = await closed_loop(t.pool, clients, segment_s)
            verdicts = [check_stream(s, CHUNKS) for s in samples]
            ok = verdicts.count("")
            errors[t.name].update(v for v in verdicts if v)
            rates[t.name].append(ok / span if span > 0 else 0.0)
        say(f"  round {r + 1:2d}: " + ", ".join(f"{n} {v[-1]:6.0f}/s" for n, v in rates.items()))
    base = targets[0].name
    out: dict[str, Any] = {"clients": clients, "rounds": rounds, "segment_s": segment_s,
                           "rates": rates, "errors": {n: dict(c) for n, c in errors.items()},
                           "median_rate": {n: statistics.median(v) for n, v in rates.items()}}
    out["ratios"] = {t.name: [round(a / b, 4) if b else math.nan
                              for a, b in zip(rates[t.name], rates[base], strict=True)]
                     for t in targets[1:]}
    out["median_ratio"] = {n: statistics.median(v) for n, v in out["ratios"].items()}
    return out


def span_counts(port: int) -> dict[str, float]:
    """sluice_telemetry_spans_total by result, from a gateway's /metrics."""
    out: dict[str, float] = {}
    for line in procs.fetch_metrics(port).splitlines():
        if line.startswith("sluice_telemetry_spans_total{"):
            result = line.split('result="', 1)[1].split('"', 1)[0]
            out[result] = float(line.rsplit(" ", 1)[1])
    return out


def start_sink(workdir: Path) -> procs.Service:
    port = procs.free_port()
    sink = procs._spawn("otlp-sink", [sys.executable, "-m", "telemetry.bench.otlp_sink",
                                      "--no-decode", "--port", str(port)], port, workdir)
    try:  # any path answers; a 404 on GET / means it is listening
        procs.wait_ready(sink, "/", 30, ok=(404,))
    except BaseException:
        sink.stop()
        raise
    return sink


async def _bench(plan: Plan, workdir: Path, stack: contextlib.ExitStack) -> dict[str, Any]:
    sink = start_sink(workdir)
    stack.callback(sink.stop)
    endpoint = f"http://127.0.0.1:{sink.port}"
    up = procs.start_fake_upstream(workdir, CHUNKS)
    stack.callback(up.stop)
    otlp = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    ratio = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}
    plugin = f"{null_exporter_plugin(workdir)}:{procs.REPO_ROOT}"
    envs = {"untraced": {"OTEL_TRACES_EXPORTER": "none"},
            "sdk-10%": {**otlp, **ratio},
            "sdk-100%": {**otlp, "OTEL_TRACES_SAMPLER": "always_on"},
            "null-10%": {"OTEL_TRACES_EXPORTER": "null", "PYTHONPATH": plugin, **ratio}}
    services: dict[str, procs.Service] = {}
    for name, env in envs.items():
        services[name] = procs.start_gateway(workdir, up.port, name=name.replace("%", ""),
                                             env=env)
        stack.callback(services[name].stop)
    direct = Target("direct", Pool("127.0.0.1", up.port, chat_request(up.port, None)))
    gateways = [Target(name, Pool("127.0.0.1", svc.port, chat_request(svc.port, procs.BENCH_KEY)),
                       svc.cpu_seconds) for name, svc in services.items()]
    report: dict[str, Any] = {"plan": asdict(plan), "chunks": CHUNKS, "receiver": endpoint,
                              "gateways": envs}
    try:
        await warm_up([direct, *gateways])
        stats = await interleaved([direct, *gateways], plan.rate, plan.seconds,
                                  plan.segment_s, CHUNKS)
        report["at_rate"] = {k: asdict(v) for k, v in stats.items()}
        _table(f"(a) {plan.rate:g} requests/s streamed chat ({CHUNKS} chunks), "
               f"{plan.seconds:g} s per target", stats, "direct")
        say("CPU per request: " + ", ".join(
            f"{g.name} {stats[g.name].cpu_us_per_request or math.nan:.0f} µs" for g in gateways))
        say(f"\n(c) saturation throughput: {SATURATION_CLIENTS} closed-loop clients, "
            f"{plan.saturation_rounds} rounds of {plan.saturation_segment_s:g} s per gateway")
        report["saturation"] = sat = await saturation(gateways, plan.saturation_rounds,
                                                      plan.saturation_segment_s)
    finally:
        for target in [direct, *gateways]:
            await target.pool.close()

    report["spans"] = counts = {name: span_counts(svc.port) for name, svc in services.items()
                                if name != "untraced"}
    say(f"\nspans by fate (sluice_telemetry_spans_total): {counts}")
    ratios = sat["median_ratio"]
    per_round = sat["ratios"]
    say("saturation throughput (median of the rounds): " + ", ".join(
        f"{n} {v:.0f}/s" for n, v in sat["median_rate"].items()))
    for name in ratios:
        say(f"  {name} / untraced per round: median {ratios[name]:.3f}, "
            f"{min(per_round[name]):.3f}-{max(per_round[name]):.3f}")
    native = [a / b for a, b in zip(sat["rates"]["null-10%"], sat["rates"]["sdk-10%"],
                                    strict=True) if b]
    native_worth = statistics.median(native) if native else math.nan
    say(f"  null-10% / sdk-10% per round (the most any exporter could win at 10 %): "
        f"median {native_worth:.3f}")
    cpu = {g.name: stats[g.name].cpu_us_per_request for g in gateways}
    report["ratios"] = {**{k: round(v, 3) for k, v in ratios.items()},
                        "null_over_sdk_10": round(native_worth, 3)}
    report["cpu_us_per_request"] = cpu
    report["verdicts"] = [
        verdict(f"saturation throughput, sdk-10% / untraced (>= {GOAL_RATE_RATIO:g})",
                ratios["sdk-10%"], ratios["sdk-10%"] >= GOAL_RATE_RATIO),
        verdict("saturation throughput, sdk-100% / untraced", ratios["sdk-100%"], None),
        verdict(f"the most any exporter could win at 10 %, null-10% / sdk-10% (a C encoder "
                f"must show >= {NATIVE_WORTH:g} to be kept)", native_worth, None),
        verdict("no span failed (export_failed == 0)", None,
                all(c.get("export_failed", 0) == 0 and c.get("exported", 0) > 0
                    for c in counts.values())),
    ]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.tracing_cost",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short run (~1 minute)")
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    parser.add_argument("--rate", type=float, default=200.0,
                        help="rate of part (a), requests/s (default 200)")
    args = parser.parse_args(argv)
    plan = Plan.quick(args.rate) if args.quick else Plan(rate=args.rate, saturation_rounds=12)
    status, report = run_bench("tracing", lambda tmp, stack: _bench(plan, tmp, stack))
    if status:
        return status
    write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
