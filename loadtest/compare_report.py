"""What `sluice loadtest compare` writes: compare.json, compare.md, a self-contained
compare.html (verdicts coloured, plots inlined as data URIs) and the PNGs: the latency
CDFs of A and B overlaid, and one forest plot per group (relative differences with their
intervals, coloured by verdict).
"""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loadtest.compare import ALL, LATENCIES, Comparison, Difference, RunInfo
from loadtest.plots import save_png
from loadtest.report_content import num as _fmt

VERDICT_COLORS = {"better": "#2ca02c", "worse": "#d62728",
                  "no significant change": "#7f7f7f", "n/a": "#bbbbbb"}
CDF_METRICS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
               ("e2e_ms", "E2E"))
HEADER = ["metric", "stat", "A", "B", "B − A", "Δ %", "CI low", "CI high", "verdict"]


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v:+.1f}%"


def _cells(d: Difference) -> list[str]:
    lo, hi = d.ci if d.ci is not None else (None, None)
    return [d.metric, d.stat, _fmt(d.a), _fmt(d.b), _fmt(d.diff), _pct(d.rel_pct), _fmt(lo),
            _fmt(hi), d.verdict]


def _groups(cmp: Comparison) -> list[str]:
    return list(dict.fromkeys(d.group for d in cmp.differences))


def _run_line(side: str, r: RunInfo) -> str:
    flags = [f for f, on in (("UNRELIABLE", r.unreliable), ("PARTIAL", r.partial)) if on]
    return (f"{side}: `{r.path}` — workload {_fmt(r.workload)}, seed {_fmt(r.seed)}, mode "
            f"{_fmt(r.mode)}, {r.measured} measured arrivals over {r.window_s:.4g} s"
            + (f" ({', '.join(flags)})" if flags else ""))


def summary_line(cmp: Comparison) -> str:
    c = cmp.verdict_counts()
    return (f"{c['better']} better, {c['worse']} worse, {c['no significant change']} no "
            f"significant change of {cmp.tested} differences tested at "
            f"{cmp.confidence:.0%} confidence; about {cmp.expected_by_chance:.1f} would "
            f"fall outside their interval by chance alone if nothing had changed")


def plot_names(cmp: Comparison) -> list[str]:
    names = ["compare_cdf.png"] if cmp.cdfs else []
    for i, g in enumerate(_groups(cmp)):
        names.append(f"compare_forest_{i}_{re.sub(r'[^A-Za-z0-9_.-]', '_', g)[:40]}.png")
    return names


def markdown(cmp: Comparison) -> str:
    lines = ["# Load test comparison: A vs B", "", "- " + _run_line("A", cmp.a),
             "- " + _run_line("B", cmp.b), ""]
    if cmp.warnings:
        lines += ["**The runs may not be comparable:**", "",
                  *[f"- {w}" for w in cmp.warnings], ""]
    lines += ["## Verdict", "", summary_line(cmp) + ".", "",
              (f"Intervals: percentile bootstrap over measured arrivals, {cmp.resamples} "
               f"resamples per run, seed {cmp.seed}. Lower is better for latencies and "
               f"reject/error shares, higher for goodput, achieved rate and attainment."), ""]
    lines += ["## Headline", "", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(_cells(d)) + " |" for d in cmp.headline]
    for group in _groups(cmp):
        title = "all measured arrivals" if group == ALL else f"class {group}"
        lines += ["", f"## {title}", "", "| " + " | ".join(HEADER) + " |",
                  "|" + "---|" * len(HEADER)]
        lines += ["| " + " | ".join(_cells(d)) + " |"
                  for d in cmp.differences if d.group == group]
    lines += ["", *[f"![{p}]({p})" for p in plot_names(cmp)], ""]
    return "\n".join(lines)


def _html_table(rows: list[Difference]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADER)
    body = []
    for d in rows:
        cells = _cells(d)
        tds = "".join(f"<td>{html.escape(c)}</td>" for c in cells[:-1])
        color = VERDICT_COLORS[d.verdict]
        body.append(f"<tr>{tds}<td class='verdict' style='color:{color}'>"
                    f"{html.escape(cells[-1])}</td></tr>")
    return f"<table class='verdicts'><tr>{head}</tr>{''.join(body)}</table>"


def html_page(cmp: Comparison, out: Path) -> str:
    parts = ["<h1>Load test comparison: A vs B</h1><ul>",
             f"<li>{html.escape(_run_line('A', cmp.a))}</li>",
             f"<li>{html.escape(_run_line('B', cmp.b))}</li></ul>"]
    if cmp.warnings:
        parts.append("<div class='warn'><b>The runs may not be comparable:</b><ul>"
                     + "".join(f"<li>{html.escape(w)}</li>" for w in cmp.warnings)
                     + "</ul></div>")
    parts += ["<h2>Verdict</h2>", f"<p>{html.escape(summary_line(cmp))}.</p>",
              "<h2>Headline</h2>", _html_table(list(cmp.headline))]
    for group in _groups(cmp):
        title = "all measured arrivals" if group == ALL else f"class {group}"
        parts += [f"<h2>{html.escape(title)}</h2>",
                  _html_table([d for d in cmp.differences if d.group == group])]
    for name in plot_names(cmp):
        path = out / name
        if path.exists():
            data = base64.b64encode(path.read_bytes()).decode()
            parts.append(f'<img alt="{html.escape(name)}" src="data:image/png;base64,{data}">')
    style = ("body{font-family:sans-serif;max-width:1200px;margin:auto}"
             "table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;"
             "padding:3px 8px;font-size:13px}td.verdict{font-weight:bold}"
             ".warn{background:#fff3cd;padding:4px 12px}"
             "img{max-width:100%;display:block;margin:12px 0}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>Sluice load test "
            f"comparison</title><style>{style}</style></head><body>{''.join(parts)}"
            f"</body></html>\n")


def cdf_plot(cmp: Comparison, path: Path) -> Path:
    """A and B latency CDFs over all measured arrivals, one panel per metric."""
    panels = [(k, t) for k, t in CDF_METRICS if k in cmp.cdfs] or \
        [(k, k) for k in LATENCIES if k in cmp.cdfs]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels, strict=True):
        for side, values, color in (("A", cmp.cdfs[key][0], "C0"),
                                    ("B", cmp.cdfs[key][1], "C1")):
            if values:
                levels = [i / (len(values) - 1) for i in range(len(values))]
                ax.plot(values, levels, label=side, color=color)
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("share")
    axes[0][0].legend(fontsize=8)
    return save_png(fig, path)


def forest_plot(cmp: Comparison, group: str, path: Path) -> Path:
    """Relative differences B − A (% of A) with their intervals, coloured by verdict."""
    rows = [d for d in cmp.differences if d.group == group and d.rel_pct is not None]
    fig, ax = plt.subplots(figsize=(7.5, 0.26 * max(4, len(rows)) + 1.2))
    for y, d in enumerate(reversed(rows)):
        color = VERDICT_COLORS[d.verdict]
        rel = d.rel_ci
        if rel is not None:
            ax.plot(rel, (y, y), color=color, lw=2)
        ax.plot([d.rel_pct or 0.0], [y], "o", color=color, ms=4)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{d.metric} {d.stat}".replace(" value", "")
                        for d in reversed(rows)], fontsize=7)
    ax.set_xlabel("B − A, % of A (bar: interval; green better, red worse)")
    title = "all measured arrivals" if group == ALL else f"class {group}"
    ax.set_title(f"{title}: {cmp.confidence:.0%} intervals")
    ax.grid(alpha=0.3, axis="x")
    return save_png(fig, path)


def write_all(out: Path, cmp: Comparison) -> list[Path]:
    """Write every artifact into ``out`` (created); returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "compare.json"]
    written[0].write_text(json.dumps(cmp.to_dict(), indent=2) + "\n")
    names = plot_names(cmp)
    forests = names[1:] if cmp.cdfs else names
    if cmp.cdfs:
        written.append(cdf_plot(cmp, out / names[0]))
    for group, name in zip(_groups(cmp), forests, strict=True):
        written.append(forest_plot(cmp, group, out / name))
    (out / "compare.md").write_text(markdown(cmp))
    (out / "compare.html").write_text(html_page(cmp, out))
    return [*written, out / "compare.md", out / "compare.html"]


def verdict_lines(cmp: Comparison) -> list[str]:
    """The short table the command prints: headline rows and every significant change."""
    def row(d: Difference) -> str:
        lo, hi = d.ci if d.ci is not None else (None, None)
        ci = f"[{_fmt(lo)}, {_fmt(hi)}]" if d.ci is not None else ""
        return (f"{d.group:<14.14} {d.metric:<16} {d.stat:<5} {_fmt(d.a):>9} {_fmt(d.b):>9} "
                f"{_pct(d.rel_pct):>8} {ci:<22} {d.verdict}")

    head = f"{'group':<14} {'metric':<16} {'stat':<5} {'A':>9} {'B':>9} {'Δ %':>8} " \
           f"{'interval of B − A':<22} verdict"
    lines = [head, *[row(d) for d in cmp.headline]]
    changed = [d for d in cmp.differences if d.verdict in ("better", "worse")]
    if changed:
        lines += ["", "significant changes:", *[row(d) for d in changed]]
    lines += ["", summary_line(cmp) + "."]
    lines += [f"warning: {w}" for w in cmp.warnings]
    return lines
