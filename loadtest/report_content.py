"""What report.md and report.html say, built once from report.json and details.json.

Both pages render the same ``Content``: a summary card (the figures a reader wants first,
and the flags that qualify them), then sections of tables whose cells are already
formatted, so the two pages can never disagree on a number. A table's totals row is kept
apart from its class rows (``Table.total``) so that each renderer can set it off; when a
table has a single class row, that row is the totals row and only the totals are shown.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loadtest.stats import LATENCY_KEYS, OUTCOMES, STAT_KEYS

PLOTS = ("latency_cdf.png", "goodput_vs_load.png", "timeline.png", "outcomes.png")
METRIC_TITLES = {
    "ttft_ms": "TTFT, time to first token (ms)",
    "tpot_ms": "TPOT, time per output token (ms)",
    "itl_ms": "ITL, inter-token latency: one value per token (ms)",
    "icl_ms": "ICL, inter-chunk latency: one value per streamed event (ms)",
    "e2e_ms": "E2E, end to end (ms)",
    "queue_ms": "Queue time, x-sluice-queue-ms (ms)",
}
LATENCY_NOTE = ("std is the sample standard deviation; percentiles interpolate linearly. "
                "ITL spreads each event's gap over its tokens, ICL counts one gap per "
                "event: they differ when the target sends several tokens per event.")
FLAGS = {
    "UNRELIABLE": "the client could not keep the schedule: the target saw less load",
    "PARTIAL": "the run was interrupted: the figures cover only what ran",
    "PROMPT SIZING UNRELIABLE": "the target's prompt_tokens stray from the planned sizes",
}


@dataclass(slots=True, frozen=True)
class Table:
    title: str  # a heading of its own ("" for none)
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    total: tuple[str, ...] | None = None  # shown last, set apart


@dataclass(slots=True, frozen=True)
class Figure:
    """One entry of the summary card."""

    label: str
    value: str
    hint: str = ""


@dataclass(slots=True, frozen=True)
class Section:
    title: str
    tables: tuple[Table, ...] = ()
    text: tuple[str, ...] = ()  # paragraphs, after the tables
    items: tuple[str, ...] = ()  # a bullet list, last


@dataclass(slots=True, frozen=True)
class Content:
    title: str
    card: tuple[Figure, ...]
    flags: tuple[tuple[str, str], ...]  # (flag, what it means)
    sections: tuple[Section, ...]
    plots: tuple[str, ...] = PLOTS


def num(v: Any) -> str:
    """A figure as the report shows it: 4 significant digits, whole numbers from 1000."""
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return str(v)


def usd(v: float | None) -> str:
    if v is None:
        return "–"
    return f"${v:.4f}" if v >= 0.01 else f"${v:.3g}"


def pct(v: float | None) -> str:
    return "–" if v is None else f"{v * 100:.1f}%"


def mode_text(details: dict[str, Any]) -> str:
    mode = details.get("mode")
    if not isinstance(mode, dict):
        return "–"
    if mode.get("kind") == "open":
        process = f" ({mode['process']})" if mode.get("process") else ""
        return f"open loop{process} at {num(mode.get('rate'))} rps"
    if mode.get("kind") == "closed":
        think = mode.get("think_time_ms")
        text = f"closed loop with {num(mode.get('concurrency'))} concurrent"
        return text + (f", think time {num(think)} ms" if think is not None else "")
    return str(mode.get("kind", "–"))


def table(title: str, header: list[str], rows: list[list[Any]], total: list[Any] | None,
          ) -> Table:
    """Cells formatted; a single class row is dropped for the totals, named after it."""
    cells = [tuple(num(c) for c in row) for row in rows]
    tot = tuple(num(c) for c in total) if total is not None else None
    if tot is not None and len(cells) == 1:
        tot = (f"all ({cells[0][0]})", *tot[1:])
        cells = []
    return Table(title, tuple(header), tuple(cells), tot)


def card(report: dict[str, Any], details: dict[str, Any], goal: float) -> tuple[Figure, ...]:
    att = report["slo_attainment"]
    verdict = "" if att is None else (": met" if att >= goal else ": missed")
    ttft = (details.get("overall") or {}).get("ttft_ms") or {}
    tput = details.get("throughput") or {}
    figures = [
        Figure("goodput", f"{num(report['goodput_rps'])} rps", "successes within SLO"),
        Figure("joint SLO attainment", pct(att), f"goal {pct(goal)}{verdict}"),
        Figure("p99 TTFT", f"{num(ttft.get('p99'))} ms", "all classes"),
        Figure("cost per success", usd(report["cost_per_success"]),
               "USD" if report["cost_per_success"] is not None else "no cost or no success"),
        Figure("offered / achieved", f"{num(report['offered_rps'])} / "
               f"{num(report['achieved_rps'])} rps", "arrivals / completed answers"),
        Figure("output tokens", f"{num(tput.get('output_tokens_per_s'))} tok/s",
               "completed answers"),
        Figure("mode", mode_text(details), f"window {num(report['duration_s'])} s"),
    ]
    if report.get("capacity_rps") is not None:
        figures.append(Figure("capacity", f"{num(report['capacity_rps'])} rps",
                              f"highest rate with attainment ≥ {pct(goal)}"))
    return tuple(figures)


def flags(report: dict[str, Any], details: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    raised = [("UNRELIABLE", bool(report.get("unreliable"))),
              ("PARTIAL", bool(report.get("partial"))),
              ("PROMPT SIZING UNRELIABLE", bool(details.get("calibration_unreliable")))]
    return tuple((name, FLAGS[name]) for name, on in raised if on)


def _stats_row(name: str, block: dict[str, Any], key: str) -> list[Any]:
    stats = block.get(key) or {}
    return [name, *[stats.get(s) for s in STAT_KEYS]]


def latency_tables(report: dict[str, Any], details: dict[str, Any]) -> tuple[Table, ...]:
    """One table per metric: a row per class, then the totals."""
    return tuple(table(METRIC_TITLES[key], ["class", *STAT_KEYS],
                       [_stats_row(k, v, key) for k, v in report["classes"].items()],
                       _stats_row("all", details["overall"], key))
                 for key in LATENCY_KEYS)


def _in_class_order(report: dict[str, Any], by: dict[str, Any]) -> list[tuple[str, Any]]:
    """``by``'s items in the order of report.json's classes (the workload's)."""
    order = {name: i for i, name in enumerate(report["classes"])}
    return sorted(by.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0]))


def overview(report: dict[str, Any], details: dict[str, Any]) -> tuple[Section, ...]:
    r = report
    outcomes = table("", ["class", *OUTCOMES],
                     [[k, *[v[o] for o in OUTCOMES]]
                      for k, v in _in_class_order(r, details["class_outcomes"])],
                     ["all", *[r["outcomes"][o] for o in OUTCOMES]])
    classes = table("", ["class", "count", "goodput rps", "SLO attainment"],
                    [[k, v["count"], v["goodput_rps"], v["slo_attainment"]]
                     for k, v in r["classes"].items()],
                    ["all", details["measured"], r["goodput_rps"], r["slo_attainment"]])
    by = details["class_slo_attainment_by_slo"]
    names = sorted({n for v in by.values() for n in v})
    per_slo = table("", ["class", *names], [[k, *[v.get(n) for n in names]]
                                            for k, v in _in_class_order(r, by)],
                    ["all", *[details["slo_attainment_by_slo"].get(n) for n in names]])
    return (Section("Outcomes (arrivals in the measured window)", (outcomes,)),
            Section("Goodput and attainment per class", (classes,)),
            Section("Latency", latency_tables(r, details), (LATENCY_NOTE,)),
            Section("SLO attainment per SLO (completed requests; the lowest binds)",
                    (per_slo,)))


def breakdowns(details: dict[str, Any]) -> tuple[Section, ...]:
    out = []
    for title, key in (("tenant", "tenants"), ("priority", "priorities")):
        out.append(Section(f"Per {title}", (table(
            "", [title, "count", "goodput rps", "attainment", "TTFT p99 ms", "E2E p99 ms",
                 "rejected", "cancelled"],
            [[k, v["count"], v["goodput_rps"], v["slo_attainment"], v["ttft_ms"]["p99"],
              v["e2e_ms"]["p99"], v["outcomes"]["rejected_429"]
              + v["outcomes"]["rejected_503"], v["outcomes"]["cancelled"]]
             for k, v in details[key].items()], None),)))
    return tuple(out)


def client_text(details: dict[str, Any]) -> str:
    c, cal = details["client"], details.get("calibration") or {}
    text = (f"Dispatch lag p99 {c['dispatch_lag_p99_ms']} ms, client CPU "
            f"{c['cpu_share']:.0%} of a core, wall {c['wall_s']} s. Prompts calibrated at "
            f"{cal.get('per_word_tokens', '–')} tokens/word + "
            f"{cal.get('overhead_tokens', '–')} (continuous usage: "
            f"{cal.get('continuous_usage', '–')}); mean prompt "
            f"{details['prompt_tokens']['mean']} tokens, mean output "
            f"{details['output_tokens']['mean']} tokens.")
    err = details.get("calibration_error") or {}
    if err.get("n"):
        text += (f" Prompt sizing error (|prompt_tokens − planned| / planned, over "
                 f"{err['n']} requests): mean {num(err['mean_abs_pct'])}%, p90 "
                 f"{num(err['p90_abs_pct'])}%, max {num(err['max_abs_pct'])}%.")
    return text


def build(report: dict[str, Any], details: dict[str, Any], sweep: list[dict[str, Any]],
          goal: float) -> Content:
    """The whole report, ready to render."""
    sections = [*overview(report, details), *breakdowns(details)]
    if sweep:
        sections.append(Section("Sweep", (table(
            "", ["offered rps", "achieved rps", "goodput rps", "attainment", "unreliable"],
            [[p["offered_rps"], p["achieved_rps"], p["goodput_rps"], p["slo_attainment"],
              p["unreliable"]] for p in sweep], None),)))
    sections.append(Section("Client", text=(client_text(details),)))
    if report["notes"]:
        sections.append(Section("Notes", items=tuple(report["notes"])))
    return Content(f"Load test: {details.get('workload')} against {details.get('target')}",
                   card(report, details, goal), flags(report, details), tuple(sections))
