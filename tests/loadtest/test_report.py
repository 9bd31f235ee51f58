"""The report from a hand-built run (no server): report.json and details.json figures,
the prompt-sizing check, and what report.md / report.html show."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loadtest.arrivals import Planned
from loadtest.artifacts import write_all
from loadtest.client import Record
from loadtest.report_content import METRIC_TITLES, mode_text, num
from loadtest.runner import RunResult
from loadtest.stats import LATENCY_KEYS, STAT_KEYS, Measured, describe
from loadtest.summary import CALIBRATION_NOTE, CLASS_KEYS, REPORT_KEYS, summarize
from loadtest.workload import Workload, parse_workload

N = 20  # arrivals, one every 0.5 s over a 10 s window
CHUNKS = (1, 3, 3, 1)  # tokens per streamed event
MODE = {"kind": "open", "rate": 2.0, "process": "constant"}


def _workload(classes: tuple[str, ...]) -> Workload:
    return parse_workload({
        "name": "synthetic", "seed": 1, "duration_s": 10.0, "model": "m",
        "arrival": {"process": "constant", "rate": 2}, "cost": {"machine_hour_usd": 3.6},
        "classes": [{"name": c, "share": 1, "slo": {"ttft_ms": 200, "e2e_ms": 5000},
                     "lengths": {"buckets": [{"input": 100, "output": 8}]}}
                    for c in classes]})


def _record(i: int, cls: str, prompt: Callable[[int], int | None]) -> Record:
    t = 0.5 * i
    plan = Planned(idx=i, t=t, cls=cls, input_tokens=100 + 10 * i, output_tokens=8,
                   tenant="ab"[i % 2], priority=5 * (i % 2), patience_s=None,
                   cancel_after=None, measured=True)
    rec = Record(plan=plan, scheduled=t, dispatched=t, sent=t)
    if i % 5 == 0:  # every fifth is turned away
        rec.status, rec.done = 429, t + 0.01
        return rec
    first = t + 0.05 + 0.01 * i  # TTFT 50 + 10 i ms: past the 200 ms SLO from i = 16
    rec.events = [(first + 0.05 * k, n) for k, n in enumerate(CHUNKS)]
    rec.chars = [4 * n for n in CHUNKS]
    rec.status, rec.finished, rec.done = 200, True, rec.events[-1][0] + 0.01
    rec.completion_tokens, rec.prompt_tokens = sum(CHUNKS), prompt(plan.input_tokens)
    return rec


def synthetic_run(classes: tuple[str, ...] = ("chat",),
                  prompt: Callable[[int], int | None] = lambda planned: planned,
                  ) -> tuple[Workload, dict[str, Any], dict[str, Any], list[Measured],
                             RunResult]:
    """A run of N arrivals as the client would have recorded them; ``prompt`` maps the
    planned input tokens to what the server reported."""
    w = _workload(classes)
    records = [_record(i, classes[i % len(classes)], prompt) for i in range(N)]
    result = RunResult(records=records, start=0.0, wall_s=10.5, client_cpu=0.2)
    report, details, ms = summarize(w, result)
    details["calibration"] = {"per_word_tokens": 1.3, "overhead_tokens": 8.0,
                              "continuous_usage": True}
    details["target"] = "http://127.0.0.1:9/v1"
    details["mode"] = MODE
    return w, report, details, ms, result


def write_report(out: Path, classes: tuple[str, ...] = ("chat",),
                 edit: Callable[[dict[str, Any]], None] | None = None,
                 prompt: Callable[[int], int | None] = lambda planned: planned,
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """All artifacts of a synthetic run in ``out``; ``edit`` may change report.json first."""
    w, report, details, ms, result = synthetic_run(classes, prompt)
    if edit is not None:
        edit(report)
    by_class: dict[str, list[Measured]] = defaultdict(list)
    for rec, m in zip(result.records, ms, strict=True):
        by_class[rec.plan.cls].append(m)
    write_all(out, report, details, dict(by_class), [], [], w.slo_attainment_goal)
    return report, details


class Tables(HTMLParser):
    """Each <table> of a page as [(the <tr>'s class, [cell texts])]."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.tables: list[list[tuple[str, list[str]]]] = []
        self.titles: list[str] = []
        self._h3 = ""
        self._in_h3 = False
        self._cell: list[str] | None = None
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self.tables.append([])
            self.titles.append(self._h3)
            self._h3 = ""
        elif tag == "tr":
            self.tables[-1].append((dict(attrs).get("class") or "", []))
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "h3":
            self._in_h3, self._h3 = True, ""

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1][1].append("".join(self._cell))
            self._cell = None
        elif tag == "h3":
            self._in_h3 = False

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        elif self._in_h3:
            self._h3 += data


def test_report_keys_and_full_statistics() -> None:
    _, report, details, ms, result = synthetic_run(("chat", "batch"))
    assert tuple(report) == REPORT_KEYS
    assert REPORT_KEYS.index("partial") == REPORT_KEYS.index("unreliable") + 1
    assert report["partial"] is False and report["unreliable"] is False
    assert CLASS_KEYS.index("icl_ms") == CLASS_KEYS.index("itl_ms") + 1
    chat = [m for r, m in zip(result.records, ms, strict=True) if r.plan.cls == "chat"]
    for name, cls in report["classes"].items():
        assert tuple(cls) == CLASS_KEYS, name
        for key in LATENCY_KEYS:
            assert tuple(cls[key]) == STAT_KEYS, (name, key)
    ttft = [m.ttft_ms for m in chat if m.ttft_ms is not None]
    assert report["classes"]["chat"]["ttft_ms"] == describe(ttft)
    assert report["classes"]["chat"]["ttft_ms"]["p50"] == round(float(np.median(ttft)), 3)
    assert report["classes"]["chat"]["ttft_ms"]["std"] == round(float(np.std(ttft, ddof=1)), 3)
    # ICL: three gaps of 50 ms per completed answer; ITL: seven values, per token
    icl = details["overall"]["icl_ms"]
    assert icl["n"] == 3 * 16 and icl["mean"] == pytest.approx(50.0)
    assert details["overall"]["itl_ms"]["n"] == 7 * 16
    assert details["overall"]["queue_ms"] == {"n": 0, **dict.fromkeys(STAT_KEYS[1:])}
    for group in ("tenants", "priorities"):
        for v in details[group].values():
            assert tuple(v["icl_ms"]) == STAT_KEYS and v["ttft_ms"]["p99.9"] is not None


def test_throughput_in_details() -> None:
    _, report, details, _, _ = synthetic_run()
    assert report["achieved_rps"] == 1.6 and report["goodput_rps"] == 1.2
    assert details["throughput"] == {"output_tokens_per_s": 16 * 8 / 10.0,
                                     "requests_per_s": 1.6}


def test_constant_prompt_tokens_are_flagged() -> None:
    _, report, details, _, result = synthetic_run(prompt=lambda planned: 120)
    planned = np.array([r.plan.input_tokens for r in result.records if r.status == 200])
    errs = np.abs(120 - planned) / planned * 100
    assert details["calibration_error"] == {
        "mean_abs_pct": round(float(errs.mean()), 2),
        "p90_abs_pct": round(float(np.percentile(errs, 90)), 2),
        "max_abs_pct": round(float(errs.max()), 2), "n": 16}
    assert errs.mean() > 10
    notes = [n for n in report["notes"] if n.startswith(CALIBRATION_NOTE)]
    assert CALIBRATION_NOTE == "prompt sizing unreliable:"
    assert len(notes) == 1 and f"{errs.mean():.1f}%" in notes[0]
    assert details["calibration_unreliable"] is True
    assert report["unreliable"] is False  # the client kept the schedule


@pytest.mark.parametrize("factor", [1.0, 1.05])
def test_prompts_sized_right_are_not_flagged(factor: float) -> None:
    _, report, details, _, _ = synthetic_run(prompt=lambda planned: round(planned * factor))
    err = details["calibration_error"]
    assert err["n"] == 16 and err["mean_abs_pct"] == pytest.approx((factor - 1) * 100,
                                                                   abs=0.5)
    assert not any(n.startswith(CALIBRATION_NOTE) for n in report["notes"])
    assert details["calibration_unreliable"] is False


def test_no_reported_prompt_tokens_means_no_error() -> None:
    details = synthetic_run(prompt=lambda planned: None)[2]
    assert details["calibration_error"] == {"mean_abs_pct": None, "p90_abs_pct": None,
                                            "max_abs_pct": None, "n": 0}
    assert details["calibration_unreliable"] is False


def test_one_class_shows_the_totals_once(tmp_path: Path) -> None:
    write_report(tmp_path)
    page = Tables((tmp_path / "report.html").read_text())
    with_total = [t for t in page.tables if any(cls == "total" for cls, _ in t)]
    # outcomes, per-class goodput, six latency tables, per-SLO attainment
    assert len(with_total) == 3 + len(LATENCY_KEYS)
    for t in with_total:
        header, *rows = t
        assert [cls for cls, _ in rows] == ["total"], header
        assert rows[0][1][0] == "all (chat)"
    md = (tmp_path / "report.md").read_text()
    assert "| chat |" not in md
    assert md.count("| **all (chat)** |") == len(with_total)


def test_several_classes_have_their_rows_and_a_distinct_total(tmp_path: Path) -> None:
    write_report(tmp_path, ("chat", "batch"))
    page = Tables((tmp_path / "report.html").read_text())
    with_total = [t for t in page.tables if any(cls == "total" for cls, _ in t)]
    assert len(with_total) == 3 + len(LATENCY_KEYS)
    for t in with_total:
        labels = [(cls, cells[0]) for cls, cells in t[1:]]
        assert labels == [("", "chat"), ("", "batch"), ("total", "all")]  # workload order
    md = (tmp_path / "report.md").read_text()
    assert md.count("| **all** |") == len(with_total)


def test_latency_tables_show_every_statistic(tmp_path: Path) -> None:
    _, details = write_report(tmp_path, ("chat", "batch"))
    page = Tables((tmp_path / "report.html").read_text())
    for key in LATENCY_KEYS:
        t = page.tables[page.titles.index(METRIC_TITLES[key])]
        assert t[0][1] == ["class", *STAT_KEYS]
        total = t[-1][1]
        assert total == ["all", *[num(details["overall"][key][s]) for s in STAT_KEYS]]


def test_summary_card_comes_first(tmp_path: Path) -> None:
    details = write_report(tmp_path)[1]
    md = (tmp_path / "report.md").read_text()
    top = md.split("\n## ", 1)[0]
    assert "- goodput: **1.2 rps**" in top
    assert "- joint SLO attainment: **60.0%** (goal 90.0%: missed)" in top
    p99 = details["overall"]["ttft_ms"]["p99"]
    assert f"- p99 TTFT: **{num(p99)} ms**" in top
    assert "- cost per success: **$0.000833** (USD)" in top  # 3.6 $/h x 10 s / 12
    assert "- offered / achieved: **2 / 1.6 rps**" in top
    assert "- mode: **open loop (constant) at 2 rps**" in top
    assert "UNRELIABLE" not in md and "PARTIAL" not in md
    page = (tmp_path / "report.html").read_text()
    card = page.split('<div class="card">', 1)[1].split("<h2>", 1)[0]
    assert '<div class="value">1.2 rps</div><div class="label">goodput</div>' in card
    assert '<div class="value">60.0%</div>' in card
    assert page.index('<div class="card">') < page.index("<h2>")


def test_flags_on_the_card(tmp_path: Path) -> None:
    def flag(report: dict[str, Any]) -> None:
        report["unreliable"] = report["partial"] = True
        report["notes"].append("unreliable: dispatch lag p99 40 ms")

    write_report(tmp_path, edit=flag)
    md = (tmp_path / "report.md").read_text()
    top = md.split("\n## ", 1)[0]
    assert "> **UNRELIABLE**" in top and "> **PARTIAL**" in top
    assert "PROMPT SIZING" not in top
    page = (tmp_path / "report.html").read_text()
    assert '<span class="flag">UNRELIABLE</span>' in page
    assert '<span class="flag">PARTIAL</span>' in page
    assert "<li>unreliable: dispatch lag p99 40 ms</li>" in page


def test_prompt_sizing_flag_on_the_card(tmp_path: Path) -> None:
    write_report(tmp_path, prompt=lambda planned: 120)
    top = (tmp_path / "report.md").read_text().split("\n## ", 1)[0]
    assert "> **PROMPT SIZING UNRELIABLE**" in top and "> **UNRELIABLE**" not in top
    assert "Prompt sizing error" in (tmp_path / "report.md").read_text()


def test_mode_text() -> None:
    assert mode_text({"mode": {"kind": "open", "rate": 12.5}}) == "open loop at 12.5 rps"
    assert mode_text({"mode": {"kind": "closed", "concurrency": 8, "think_time_ms": None}}
                     ) == "closed loop with 8 concurrent"
    assert mode_text({"mode": {"kind": "closed", "concurrency": 8, "think_time_ms": 250.0}}
                     ) == "closed loop with 8 concurrent, think time 250 ms"
    assert mode_text({}) == "–"


def test_one_run_plots_its_rates_and_attainment_against_the_goal() -> None:
    import matplotlib.pyplot as plt

    from loadtest import plots

    fig = plots.goodput_figure([{"offered_rps": 2.0, "achieved_rps": 1.6,
                                 "goodput_rps": 1.2, "slo_attainment": 0.6}], None, 0.9)
    rates, attainment = fig.axes  # two panels side by side, no twin axis
    assert [b.get_height() for b in rates.patches] == [2.0, 1.6, 1.2]
    assert [b.get_height() for b in attainment.patches] == [0.6]
    goal = [ln for ln in attainment.get_lines() if ln.get_label() == "goal 0.9"]
    assert len(goal) == 1 and list(goal[0].get_ydata()) == [0.9, 0.9]
    assert attainment.get_ylim()[1] <= 1.1 and rates.get_lines() == []
    plt.close(fig)


def test_sweep_draws_the_goal_on_the_attainment_axis() -> None:
    import matplotlib.pyplot as plt

    from loadtest import plots

    pts = [{"offered_rps": r, "achieved_rps": r * 0.9, "goodput_rps": g,
            "slo_attainment": a} for r, g, a in ((1.0, 0.95, 0.95), (2.0, 1.5, 0.75),
                                                 (4.0, 1.0, 0.25))]
    fig = plots.goodput_figure(pts, 1.5, 0.9)
    rates, right = fig.axes
    labels = {ln.get_label(): ax for ax in (rates, right) for ln in ax.get_lines()}
    assert labels["attainment goal 0.9 (right axis)"] is right
    assert labels["joint SLO attainment (right axis)"] is right
    assert labels["goodput (req/s)"] is rates
    legend = rates.get_legend()
    assert legend is not None
    assert "attainment goal 0.9 (right axis)" in [t.get_text() for t in legend.get_texts()]
    plt.close(fig)
