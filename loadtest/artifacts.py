"""Everything a run leaves in ``--out DIR``: report.json, details.json, requests.jsonl,
report.md, the PNG plots, and report.html with the plots embedded (one file to mail).

report.md and report.html render the same ``report_content.Content``; neither is made
from the other.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loadtest.report_content import PLOTS, Content, Table, build
from loadtest.stats import Measured

__all__ = ["PLOTS", "markdown", "write_all"]


def _md_row(cells: tuple[str, ...], bold: bool = False) -> str:
    shown = [f"**{c}**" if bold and c else c for c in cells]
    return "| " + " | ".join(shown) + " |"


def md_table(t: Table) -> list[str]:
    out = [f"### {t.title}", ""] if t.title else []
    out += [_md_row(t.header), "|" + "---|" * len(t.header)]
    out += [_md_row(row) for row in t.rows]
    if t.total is not None:
        out.append(_md_row(t.total, bold=True))
    return out


def markdown(c: Content) -> str:
    lines = [f"# {c.title}", ""]
    for flag, meaning in c.flags:
        lines += [f"> **{flag}** – {meaning}", ">"]
    if c.flags:
        lines[-1] = ""
    for f in c.card:
        lines.append(f"- {f.label}: **{f.value}**" + (f" ({f.hint})" if f.hint else ""))
    for s in c.sections:
        lines += ["", f"## {s.title}"]
        for t in s.tables:
            lines += ["", *md_table(t)]
        lines += [x for p in s.text for x in ("", p)]
        if s.items:
            lines += ["", *[f"- {i}" for i in s.items]]
    lines += ["", *[f"![{p}]({p})" for p in c.plots], ""]
    return "\n".join(lines)


def write_all(out: Path, report: dict[str, Any], details: dict[str, Any],
              by_class: dict[str, list[Measured]], requests: list[dict[str, Any]],
              sweep: list[dict[str, Any]], goal: float) -> list[Path]:
    """Write every artifact into ``out``; returns their paths."""
    from loadtest import plots
    from loadtest.report_html import html_page

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
    content = build(report, details, sweep, goal)
    (out / "report.md").write_text(markdown(content))
    (out / "report.html").write_text(html_page(content, out))
    return [*written, out / "report.md", out / "report.html"]
