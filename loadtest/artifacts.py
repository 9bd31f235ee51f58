"""Everything a run leaves in ``--out DIR``: report.json, details.json, requests.jsonl,
report.md, the PNG plots, and report.html with the plots embedded (one file to mail).
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from loadtest.stats import OUTCOMES, Measured

PLOTS = ("latency_cdf.png", "goodput_vs_load.png", "timeline.png", "outcomes.png")
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "queue_ms")


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return out


def _latency_rows(name: str, block: dict[str, Any]) -> list[Any]:
    row: list[Any] = [name]
    for key in LATENCIES:
        q = block.get(key) or {}
        row.append(" / ".join(_fmt(q.get(p)) for p in ("p50", "p95", "p99")))
    return row


def markdown(report: dict[str, Any], details: dict[str, Any],
             sweep: list[dict[str, Any]]) -> str:
    r = report
    lines = [f"# Load test: {details.get('workload')} against {details.get('target')}", ""]
    if r["unreliable"]:
        lines += ["**UNRELIABLE RUN** – " + "; ".join(r["notes"]), ""]
    lines += _table(["offered rps", "achieved rps", "goodput rps", "joint SLO attainment",
                     "window s", "cost per success (USD)", "capacity rps"],
                    [[r["offered_rps"], r["achieved_rps"], r["goodput_rps"],
                      r["slo_attainment"], r["duration_s"], r["cost_per_success"],
                      r["capacity_rps"]]])
    lines += ["", "## Outcomes (arrivals in the measured window)", ""]
    lines += _table(["class", *OUTCOMES],
                    [[k, *[v[o] for o in OUTCOMES]]
                     for k, v in details["class_outcomes"].items()]
                    + [["**all**", *[r["outcomes"][o] for o in OUTCOMES]]])
    lines += ["", "## Latency, ms (P50 / P95 / P99)", ""]
    lines += _table(["class", "count", "goodput rps", "attainment", *LATENCIES],
                    [[k, v["count"], v["goodput_rps"], v["slo_attainment"],
                      *_latency_rows(k, v)[1:]] for k, v in r["classes"].items()]
                    + [["**all**", details["measured"], r["goodput_rps"],
                        r["slo_attainment"], *_latency_rows("", details["overall"])[1:]]])
    lines += ["", "## SLO attainment per SLO (completed requests; the lowest binds)", ""]
    by = details["class_slo_attainment_by_slo"]
    names = sorted({n for v in by.values() for n in v})
    lines += _table(["class", *names], [[k, *[v.get(n) for n in names]] for k, v in by.items()]
                    + [["**all**", *[details["slo_attainment_by_slo"].get(n)
                                     for n in names]]])
    for title, key in (("tenant", "tenants"), ("priority", "priorities")):
        lines += ["", f"## Per {title}", ""]
        lines += _table([title, "count", "goodput rps", "attainment", "TTFT p99 ms",
                         "E2E p99 ms", "rejected", "cancelled"],
                        [[k, v["count"], v["goodput_rps"], v["slo_attainment"],
                          v["ttft_ms"]["p99"], v["e2e_ms"]["p99"],
                          v["outcomes"]["rejected_429"] + v["outcomes"]["rejected_503"],
                          v["outcomes"]["cancelled"]] for k, v in details[key].items()])
    if sweep:
        lines += ["", "## Sweep", ""]
        lines += _table(["offered rps", "achieved rps", "goodput rps", "attainment",
                         "unreliable"],
                        [[p["offered_rps"], p["achieved_rps"], p["goodput_rps"],
                          p["slo_attainment"], p["unreliable"]] for p in sweep])
    c = details["client"]
    lines += ["", "## Client", "",
              (f"dispatch lag p99 {c['dispatch_lag_p99_ms']} ms, client CPU "
              f"{c['cpu_share']:.0%} of a core, wall {c['wall_s']} s; prompts calibrated at "
              f"{details['calibration']['per_word_tokens']} tokens/word + "
              f"{details['calibration']['overhead_tokens']} (continuous usage: "
              f"{details['calibration']['continuous_usage']}); mean prompt "
              f"{details['prompt_tokens']['mean']} tokens, mean output "
              f"{details['output_tokens']['mean']} tokens.")]
    if r["notes"]:
        lines += ["", "Notes:", *[f"- {n}" for n in r["notes"]]]
    lines += ["", *[f"![{p}]({p})" for p in PLOTS], ""]
    return "\n".join(lines)


def _md_table_to_html(lines: list[str]) -> str:
    rows = [ln.strip("|").split(" | ") for ln in lines if not ln.startswith("|---")]
    head = "".join(f"<th>{html.escape(c.strip())}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c.strip().strip('*'))}</td>"
                                    for c in row) + "</tr>" for row in rows[1:])
    return f"<table><tr>{head}</tr>{body}</table>"


def html_page(md: str, out: Path) -> str:
    """report.md as a self-contained page: tables as tables, plots inlined as data URIs."""
    parts, table = [], []
    for line in md.splitlines() + [""]:
        if line.startswith("|"):
            table.append(line)
            continue
        if table:
            parts.append(_md_table_to_html(table))
            table = []
        if line.startswith("# "):
            parts.append(f"<h1>{html.escape(line[2:])}</h1>")
        elif line.startswith("## "):
            parts.append(f"<h2>{html.escape(line[3:])}</h2>")
        elif line.startswith("![") and "](" in line:
            name = line.split("](", 1)[1].rstrip(")")
            path = out / name
            if path.exists():
                data = base64.b64encode(path.read_bytes()).decode()
                parts.append(f'<img alt="{html.escape(name)}" '
                             f'src="data:image/png;base64,{data}">')
        elif line.startswith("- "):
            parts.append(f"<li>{html.escape(line[2:])}</li>")
        elif line:
            parts.append(f"<p>{html.escape(line.replace('**', ''))}</p>")
    style = ("body{font-family:sans-serif;max-width:1200px;margin:auto}"
             "table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;"
             "padding:3px 8px;font-size:13px}img{max-width:100%;display:block;margin:12px 0}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>Sluice load test"
            f"</title><style>{style}</style></head><body>{''.join(parts)}</body></html>\n")


def write_all(out: Path, report: dict[str, Any], details: dict[str, Any],
              by_class: dict[str, list[Measured]], requests: list[dict[str, Any]],
              sweep: list[dict[str, Any]], goal: float) -> list[Path]:
    """Write every artifact into ``out``; returns their paths."""
    from loadtest import plots

    out.mkdir(parents=True, exist_ok=True)
    written = [out / "report.json", out / "details.json", out / "requests.jsonl"]
    written[0].write_text(json.dumps(report, indent=2) + "\n")
    written[1].write_text(json.dumps({**details, "sweep": sweep}, indent=2) + "\n")
    written[2].write_text("".join(json.dumps(r) + "\n" for r in requests))
    point = {k: report[k] for k in ("offered_rps", "achieved_rps", "goodput_rps",
                                    "slo_attainment")}
    written += [plots.latency_cdfs(by_class, out),
                plots.goodput_curve(sweep or [point], report["capacity_rps"], goal, out),
                plots.timeline(details, out),
                plots.outcomes(details["class_outcomes"], out)]
    md = markdown(report, details, sweep)
    (out / "report.md").write_text(md)
    (out / "report.html").write_text(html_page(md, out))
    return [*written, out / "report.md", out / "report.html"]
