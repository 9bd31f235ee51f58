"""`--sweep-concurrency 1,4,16,64`: closed loop at each concurrency, throughput against latency.

More users in flight buy throughput with latency: each point is one full closed-loop run
(its own report in ``OUT/c<N>/``), and the sweep's page plots requests/s against E2E and
output tokens/s against TPOT, one labelled point per concurrency, so the knee shows where
adding users stops adding throughput.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from loadtest.plots import save_png
from loadtest.run import Measurement
from loadtest.sweep import Probe
from loadtest.workload import Workload


def _q(block: Any, key: str) -> float | None:
    return block.get(key) if isinstance(block, dict) else None


def point(n: int, m: Measurement) -> dict[str, Any]:
    """One concurrency's figures (overall, over its measured window)."""
    r, d = m.report, m.details
    overall = d.get("overall", {})
    return {
        "concurrency": n, "achieved_rps": r["achieved_rps"], "goodput_rps": r["goodput_rps"],
        "slo_attainment": r["slo_attainment"],
        "output_tokens_per_s": (d.get("throughput") or {}).get("output_tokens_per_s"),
        **{f"{metric}_{q}": _q(overall.get(f"{metric}_ms"), q)
           for metric in ("ttft", "tpot", "e2e") for q in ("p50", "p99")},
        "unreliable": r["unreliable"], "partial": bool(r.get("partial"))}


async def sweep_concurrency(w: Workload, probe: Probe, levels: list[int], out: Path,
                            stop: asyncio.Event | None = None) -> Measurement:
    """Run ``w`` closed loop at each of ``levels``; write each run and the sweep's page.
    Returns the last run, its ``sweep`` holding the points."""
    from loadtest.command import write_measurement

    points: list[dict[str, Any]] = []
    last: Measurement | None = None
    for n in levels:
        wl = w.model_copy(update={"concurrency": n, "arrival": None})
        m = await probe(wl, f"concurrency {n} ({len(points) + 1}/{len(levels)})")
        write_measurement(out / f"c{n}", wl, m)
        points.append(point(n, m))
        last = m
        if stop is not None and stop.is_set():
            break
    assert last is not None
    last.sweep = points
    write_sweep(out, w, points)
    return last


def plot(points: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib.pyplot as plt  # (loadtest.plots chose the Agg backend)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    panels = ((axes[0], "achieved_rps", "e2e", "requests/s", "E2E ms"),
              (axes[1], "output_tokens_per_s", "tpot", "output tokens/s", "TPOT ms"))
    for ax, x_key, metric, xlabel, ylabel in panels:
        pts = [p for p in points if p.get(x_key) is not None]
        xs = [p[x_key] for p in pts]
        for q, style in (("p50", "o-"), ("p99", "x--")):
            ys = [p[f"{metric}_{q}"] for p in pts]
            if any(y is not None for y in ys):
                ax.plot(xs, [y if y is not None else float("nan") for y in ys], style,
                        label=f"{metric.upper()} {q}")
        for p in pts:
            y = p.get(f"{metric}_p50")
            if y is not None:
                ax.annotate(f"N={p['concurrency']}", (p[x_key], y), fontsize=8,
                            textcoords="offset points", xytext=(4, 4))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    axes[0].set_title("throughput vs end-to-end latency")
    axes[1].set_title("token throughput vs time per output token")
    return save_png(fig, out / "concurrency.png")


COLUMNS = ("concurrency", "achieved_rps", "goodput_rps", "slo_attainment",
           "output_tokens_per_s", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p50",
           "e2e_p99", "unreliable")


def write_sweep(out: Path, w: Workload, points: list[dict[str, Any]]) -> list[Path]:
    """concurrency.json, concurrency.png, report.md and report.html of the sweep (the same
    page layout as a run's report)."""
    from loadtest.artifacts import markdown
    from loadtest.report_content import Content, Section, Table, num
    from loadtest.report_html import html_page

    out.mkdir(parents=True, exist_ok=True)
    (out / "concurrency.json").write_text(json.dumps(points, indent=2) + "\n")
    png = plot(points, out)
    table = Table("", COLUMNS, tuple(tuple(num(p.get(c)) for c in COLUMNS) for p in points))
    runs = tuple(f"concurrency {p['concurrency']}: c{p['concurrency']}/report.html"
                 for p in points)
    content = Content(f"Concurrency sweep: {w.name}", (), (), (
        Section("Closed loop at each concurrency (latencies in ms, overall)", (table,),
                ("Each run's full report is in its own directory:",), runs),),
        plots=(png.name,))
    (out / "report.md").write_text(markdown(content))
    (out / "report.html").write_text(html_page(content, out))
    return [out / "concurrency.json", png, out / "report.md", out / "report.html"]
