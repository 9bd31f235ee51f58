"""The report's PNG plots (matplotlib, Agg backend: no display needed).

Four figures: latency CDFs per class, goodput against offered load (the sweep's curve, or
for a single run its rates and attainment against the goal), a timeline of rate / queue / KV / rejects on the client's clock, and
the outcome breakdown per class. Each function writes one file and returns its path.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loadtest.stats import OUTCOMES, Measured

COLORS = {"success": "#2ca02c", "slo_miss": "#bcbd22", "rejected_429": "#ff7f0e",
          "rejected_503": "#d62728", "timeout": "#9467bd", "error": "#7f7f7f",
          "cancelled": "#17becf"}


def save_png(fig: Any, path: Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` and close it (every report plot goes through here)."""
    with warnings.catch_warnings():  # a crowded legend only loses some margin
        warnings.simplefilter("ignore", UserWarning)
        fig.tight_layout()
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path


def latency_cdfs(by_class: dict[str, list[Measured]], out: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (attr, title) in zip(axes, (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"),
                                        ("e2e_ms", "E2E")), strict=True):
        for name, ms in by_class.items():
            values = sorted(v for m in ms if (v := getattr(m, attr)) is not None)
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))],
                        label=name, drawstyle="steps-post")
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share of requests")
    axes[0].legend(fontsize=8)
    return save_png(fig, out / "latency_cdf.png")


def goodput_curve(points: list[dict[str, Any]], capacity: float | None, goal: float,
                  out: Path) -> Path:
    """``points``: [{offered_rps, achieved_rps, goodput_rps, slo_attainment}]; a sweep's
    curve, or with one point the run's own rates and attainment."""
    return save_png(goodput_figure(points, capacity, goal), out / "goodput_vs_load.png")


def goodput_figure(points: list[dict[str, Any]], capacity: float | None, goal: float,
                   ) -> Any:
    if len(points) < 2:
        return _goodput_single(points[0], goal)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    pts = sorted(points, key=lambda p: p["offered_rps"])
    xs = [p["offered_rps"] for p in pts]
    ax.plot(xs, xs, ls=":", color="grey", label="offered (req/s)")
    ax.plot(xs, [p["goodput_rps"] for p in pts], marker="o", color="C2",
            label="goodput (req/s)")
    ax.plot(xs, [p["achieved_rps"] for p in pts], marker=".", color="C0", alpha=0.6,
            label="achieved (req/s)")
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel("req/s")
    # attainment and its goal share the right axis, drawn in one colour, so the goal line
    # reads against attainment and never against req/s
    ax2 = ax.twinx()
    ax2.plot(xs, [p["slo_attainment"] or 0 for p in pts], color="C3", marker="x",
             label="joint SLO attainment (right axis)")
    ax2.axhline(goal, color="C3", ls="--", lw=1,
                label=f"attainment goal {goal:g} (right axis)")
    ax2.text(xs[0], goal, f" goal {goal:g}", color="C3", va="bottom", fontsize=8)
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("joint SLO attainment", color="C3")
    ax2.tick_params(axis="y", colors="C3")
    if capacity:
        ax.axvline(capacity, color="k", lw=0.8)
        ax.text(capacity, 0.02, f" capacity {capacity:.3g}", va="bottom",
                transform=ax.get_xaxis_transform())
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2,
              fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title("goodput vs offered load (sweep)")
    return fig


def _goodput_single(point: dict[str, Any], goal: float) -> Any:
    """One run: its three rates as bars, and its attainment against the goal on a
    separate 0..1 axis."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(7.5, 4),
                                  gridspec_kw={"width_ratios": [3, 1.4]})
    names = ["offered", "achieved", "goodput"]
    vals = [point["offered_rps"], point["achieved_rps"], point["goodput_rps"]]
    bars = ax.bar(names, vals, color=["grey", "C0", "C2"])
    ax.bar_label(bars, labels=[f"{v:.3g}" for v in vals], fontsize=9)
    ax.set_ylabel("req/s")
    ax.set_ylim(0, max(vals + [1e-9]) * 1.18)
    ax.set_title("this run's rates (no sweep)")
    ax.grid(alpha=0.3, axis="y")
    att = point["slo_attainment"]
    color = "C2" if att is not None and att >= goal else "C3"
    bar = ax2.bar(["attainment"], [att or 0.0], color=color, width=0.5)
    ax2.bar_label(bar, labels=["–" if att is None else f"{att:.1%}"], fontsize=9)
    ax2.axhline(goal, color="k", ls="--", lw=1, label=f"goal {goal:g}")
    ax2.set_ylim(0, 1.1)
    ax2.set_ylabel("joint SLO attainment (share of arrivals)")
    ax2.set_title("joint SLO attainment")
    ax2.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), fontsize=8)
    return fig


def timeline(details: dict[str, Any], out: Path) -> Path:
    rows = details["timeline"]
    fig, axes = plt.subplots(3, 1, figsize=(10, 7), sharex=True)
    t = [r["t"] for r in rows]
    axes[0].plot(t, [r["sent"] for r in rows], label="sent/s")
    axes[0].plot(t, [r["served"] for r in rows], label="served/s")
    axes[0].plot(t, [r["success"] for r in rows], label="good/s")
    axes[0].plot(t, [r["rejected"] for r in rows], label="rejected/s")
    axes[0].plot(t, [r["cancelled"] for r in rows], label="abandoned/s")
    axes[0].set_ylabel("req/s (client)")
    scraped: dict[str, list[dict[str, Any]]] = {}
    for s in details.get("scraped", []):
        scraped.setdefault(s["url"], []).append(s)
    for url, samples in scraped.items():
        host = url.split("//", 1)[-1].split("/", 1)[0]
        ts = [s["t"] for s in samples]
        for key in ("queue", "running", "queue_backend", "running_backend"):
            if any(key in s for s in samples):
                axes[1].plot(ts, [s.get(key, 0) for s in samples], label=f"{key} {host}")
        if any("kv_usage" in s for s in samples):
            axes[2].plot(ts, [s.get("kv_usage", 0) for s in samples], label=f"KV use {host}")
        if any("rejects" in s for s in samples):
            rej = [s.get("rejects", 0) for s in samples]
            rate = [0.0] + [max(0.0, (b - a) / max(1e-9, t1 - t0)) for a, b, t0, t1
                            in zip(rej, rej[1:], ts, ts[1:], strict=False)]
            axes[2].plot(ts, rate, label=f"rejects/s {host}", ls="--")
    axes[1].set_ylabel("requests (server)")
    axes[2].set_ylabel("KV share / rejects")
    axes[2].set_xlabel("seconds since start")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper right")
    if not scraped:
        axes[1].text(0.5, 0.5, "no /metrics on the target", transform=axes[1].transAxes,
                     ha="center")
    fig.suptitle("timeline")
    return save_png(fig, out / "timeline.png")


def outcomes(class_outcomes: dict[str, dict[str, int]], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(class_outcomes) + 2.6))
    names = list(class_outcomes)
    left = [0] * len(names)
    for o in OUTCOMES:
        vals = [class_outcomes[n][o] for n in names]
        ax.barh(names, vals, left=left, color=COLORS[o], label=o)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    ax.set_xlabel("arrivals in the measured window")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    ax.set_title("outcomes per class")
    return save_png(fig, out / "outcomes.png")
