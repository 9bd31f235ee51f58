"""`sluice loadtest compare`: bootstrap intervals and verdicts on synthesized run dirs.

Every check is statistical but seeded, so deterministic; none depends on timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import loadtest
from loadtest.compare import (
    STATS,
    CompareError,
    Comparison,
    Difference,
    Group,
    compare_main,
    compare_runs,
    difference,
    pooled,
    weighted_stats,
    write_comparison,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
WINDOW_S = 50.0


def make_rows(n: int, seed: int, shift_ms: float = 0.0, success: float = 0.9,
              classes: tuple[str, ...] = ("chat",), lists: bool = True) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        ok = rng.random() < success
        row: dict[str, Any] = {
            "idx": i, "t": i * 0.1, "class": classes[i % len(classes)], "tenant": "t",
            "priority": 0, "measured": True, "outcome": "success" if ok else "rejected_503",
            "status": 200 if ok else 503, "dispatch_lag_ms": 0.1,
            "ttft_ms": float(rng.lognormal(np.log(100), 0.4)) + shift_ms if ok else None,
            "tpot_ms": float(rng.lognormal(np.log(20), 0.2)) if ok else None,
            "e2e_ms": float(rng.lognormal(np.log(600), 0.3)) if ok else None,
            "queue_ms": None, "input_tokens": 32, "prompt_tokens": 40, "output_tokens": 16,
            "cancelled": None, "error": None}
        if lists:
            speed = float(rng.lognormal(np.log(20), 0.2))  # tokens of one answer correlate
            row["itl_ms"] = (speed * rng.lognormal(0, 0.1, 15)).tolist() if ok else []
            row["icl_ms"] = (speed * 3 * rng.lognormal(0, 0.1, 5)).tolist() if ok else []
        rows.append(row)
    # warm-up arrivals: outside the window, never compared
    rows.append({**rows[0], "idx": n, "measured": False, "ttft_ms": 1e6})
    return rows


def write_run(d: Path, rows: list[dict[str, Any]], *, details: dict[str, Any] | None = None,
              **report: Any) -> Path:
    d.mkdir(parents=True)
    (d / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    measured = [r for r in rows if r["measured"]]
    wins = sum(r["outcome"] == "success" for r in measured)
    base = {"offered_rps": len(measured) / WINDOW_S, "achieved_rps": wins / WINDOW_S,
            "goodput_rps": wins / WINDOW_S, "slo_attainment": wins / len(measured),
            "duration_s": WINDOW_S, "outcomes": {}, "classes": {}, "cost_per_success": None,
            "capacity_rps": None, "unreliable": False, "notes": []}
    (d / "report.json").write_text(json.dumps({**base, **report}))
    (d / "details.json").write_text(json.dumps(
        details if details is not None else {"workload": "mixed", "seed": 7, "mode": "open"}))
    return d


def find(cmp: Comparison, metric: str, stat: str, group: str = "all") -> Difference:
    return next(d for d in cmp.differences
                if (d.group, d.metric, d.stat) == (group, metric, stat))


def test_weighted_stats_equal_percentiles_of_the_concatenated_resample() -> None:
    rng = np.random.default_rng(3)
    for trial in range(20):
        n = int(rng.integers(1, 80))
        lists = [rng.lognormal(3, 1, int(rng.integers(0, 12))) for _ in range(n)]
        if trial % 2:
            lists = [np.round(v) for v in lists]  # ties
        idx = rng.integers(0, n, size=(15, n))
        w = np.stack([np.bincount(row, minlength=n) for row in idx]).astype(np.float64)
        p = pooled([v.tolist() for v in lists])
        if trial % 3 == 0:  # a window of bin 0 only: every replicate takes the full pass
            p = replace(p, windows=((0, 1, np.zeros(n)),) * 3)
        got = weighted_stats(p, w)
        for b in range(len(idx)):
            cat = np.concatenate([lists[i] for i in idx[b]])
            if not len(cat):
                assert np.isnan(got[:, b]).all()
                continue
            want = [*np.percentile(cat, [50, 90, 99]), cat.mean()]
            assert got[:, b] == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_shifted_ttft_is_worse_and_the_interval_holds_the_shift(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", make_rows(500, seed=1))
    b = write_run(tmp_path / "b", make_rows(500, seed=2, shift_ms=20.0))
    cmp = compare_runs(a, b, resamples=1000, seed=0)
    d = find(cmp, "ttft_ms", "p50")
    assert d.verdict == "worse"
    assert d.ci is not None and 0 < d.ci[0] < 20 < d.ci[1]
    assert find(cmp, "ttft_ms", "mean").verdict == "worse"
    assert find(cmp, "ttft_ms", "p50", group="chat").verdict == "worse"
    # the warm-up row (TTFT 1e6 ms) never entered a statistic
    assert d.b is not None and d.b < 1000
    assert not cmp.warnings


def test_identical_runs_change_nothing(tmp_path: Path) -> None:
    rows = make_rows(400, seed=5, classes=("chat", "batch"))
    a, b = write_run(tmp_path / "a", rows), write_run(tmp_path / "b", rows)
    cmp = compare_runs(a, b, resamples=500, seed=1)
    assert cmp.tested > 50
    for d in (*cmp.differences, *cmp.headline):
        assert d.verdict in ("no significant change", "n/a"), d
        assert d.diff in (0.0, None)
        if d.ci is not None:
            assert d.ci[0] <= 0 <= d.ci[1]
    metrics = {d.metric for d in cmp.differences}
    assert "queue_ms" not in metrics  # no data on either side: skipped
    assert {"ttft_ms", "itl_ms", "icl_ms", "goodput_rps"} <= metrics
    assert {d.group for d in cmp.differences} == {"all", "chat", "batch"}
    assert {d.stat for d in cmp.differences if d.metric == "e2e_ms"} == set(STATS)


def test_goodput_gain_is_detected(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", make_rows(500, seed=1, success=0.6))
    b = write_run(tmp_path / "b", make_rows(500, seed=2, success=0.8))
    cmp = compare_runs(a, b, resamples=1000)
    for metric in ("goodput_rps", "slo_attainment"):
        d = find(cmp, metric, "value")
        assert d.verdict == "better"
        assert d.ci is not None and d.ci[0] > 0
    assert find(cmp, "reject_share", "value").verdict == "better"  # fewer 503s
    head = {d.metric: d for d in cmp.headline}
    assert head["goodput_rps"].verdict == "better"
    assert head["offered_rps"].verdict == "n/a" and head["offered_rps"].ci is None
    assert head["cost_per_success"].verdict == "n/a"


def null_rows(metric: str, n: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    """Rows of one distribution carrying only ``metric`` (ITL: 15 correlated tokens)."""
    if metric == "itl_ms":
        speed = rng.lognormal(np.log(20), 0.3, n)
        values: list[Any] = [(s * rng.lognormal(0, 0.1, 15)).tolist() for s in speed]
    else:
        values = rng.lognormal(np.log(100), 0.4, n).tolist()
    return [{"class": "x", "outcome": "success", metric: v} for v in values]


@pytest.mark.parametrize("metric", ["ttft_ms", "itl_ms"])
def test_false_positives_stay_near_the_nominal_rate(metric: str) -> None:
    """100 A/Bs of one distribution: a 95% interval for the P50 difference should exclude 0
    about 5% of the time. ITL checks the cluster bootstrap: its tokens are correlated
    within a request, which a token-level resample would ignore (and cry wolf)."""
    rng = np.random.default_rng(11)
    excluded = 0
    for _ in range(100):
        groups = [Group.of(null_rows(metric, 150, rng), WINDOW_S, "synthetic") for _ in "ab"]
        reps = [g.replicates(300, rng)[metric][0] for g in groups]
        point = [float(np.percentile(g.metrics[metric].values, 50)) for g in groups]
        d = difference("all", metric, "p50", point[0], point[1], (reps[0], reps[1]), 0.95)
        excluded += d.verdict != "no significant change"
    assert excluded <= 15


def test_same_seed_same_result_and_the_seed_matters(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", make_rows(300, seed=1))
    b = write_run(tmp_path / "b", make_rows(300, seed=2))
    one = compare_runs(a, b, resamples=300, seed=4).to_dict()
    assert one == compare_runs(a, b, resamples=300, seed=4).to_dict()
    assert one != compare_runs(a, b, resamples=300, seed=5).to_dict()


def test_older_runs_without_itl_lists(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", make_rows(200, seed=1, lists=False))
    b = write_run(tmp_path / "b", make_rows(200, seed=2, lists=False))
    cmp = compare_runs(a, b, resamples=200)
    assert not {"itl_ms", "icl_ms"} & {d.metric for d in cmp.differences}


def test_warns_when_the_runs_are_not_comparable(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", make_rows(200, seed=1), unreliable=True,
                  notes=["unreliable: dispatch lag p99 40 ms"])
    rows_b = make_rows(220, seed=2, classes=("chat", "extra"))
    b = write_run(tmp_path / "b", rows_b, partial=True,
                  details={"workload": "other", "seed": 8, "mode": "open"})
    text = "\n".join(compare_runs(a, b, resamples=200).warnings)
    for phrase in ("run A is flagged unreliable", "dispatch lag", "run B is partial",
                   "different workload", "different seed", "more than 5% apart",
                   "class 'extra' only in run B"):
        assert phrase in text
    assert "different mode" not in text and "measured only" not in text
    few = write_run(tmp_path / "few", make_rows(20, seed=3))
    text = "\n".join(compare_runs(a, few, resamples=200).warnings)
    assert "run B measured only" in text and "run A measured only" not in text
    extra = find(compare_runs(a, b, resamples=200), "ttft_ms", "p50", group="extra")
    assert extra.a is None and extra.verdict == "n/a"


def test_missing_or_invalid_run_dirs(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     ) -> None:
    a = write_run(tmp_path / "a", make_rows(50, seed=1))
    with pytest.raises(CompareError, match="no such run directory"):
        compare_runs(a, tmp_path / "nope")
    assert compare_main(str(a), str(tmp_path / "nope"), str(tmp_path / "out"), 0.95, 200,
                        0) == 2
    assert "no such run directory" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CompareError, match="report.json: missing"):
        compare_runs(a, empty)
    bad = write_run(tmp_path / "bad", make_rows(50, seed=2))
    (bad / "requests.jsonl").write_text('{"class": "chat", "outcome": "success"}\n{oops\n')
    with pytest.raises(CompareError, match=r"requests.jsonl:2: bad JSON"):
        compare_runs(a, bad)
    with pytest.raises(CompareError, match="confidence"):
        compare_runs(a, a, confidence=1.5)


def test_writes_json_md_html_with_inline_plots(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    a = write_run(tmp_path / "a", make_rows(300, seed=1))
    b = write_run(tmp_path / "b", make_rows(300, seed=2, shift_ms=30.0))
    out = tmp_path / "cmp"
    assert compare_main(str(a), str(b), str(out), 0.9, 300, 0) == 0
    printed = capsys.readouterr().out
    assert "ttft_ms" in printed and "worse" in printed and "compare.html" in printed
    names = {p.name for p in out.iterdir()}
    assert {"compare.json", "compare.md", "compare.html", "compare_cdf.png",
            "compare_forest_0_all.png", "compare_forest_1_chat.png"} <= names
    page = (out / "compare.html").read_text()
    assert "<table class='verdicts'>" in page and "worse" in page
    assert page.count("data:image/png;base64,") == 3
    data = json.loads((out / "compare.json").read_text())
    assert data["verdict_counts"]["worse"] >= 1 and data["confidence"] == 0.9
    assert "| ttft_ms | p50 |" in (out / "compare.md").read_text()
    cmp = compare_runs(a, b, resamples=200)
    assert {p.name for p in write_comparison(tmp_path / "again", cmp)} == names


def _cli_wired() -> bool:
    here = Path(loadtest.__file__).parent
    return any("compare_main" in (here / f).read_text() for f in ("cli.py", "command.py"))


@pytest.mark.skipif(not _cli_wired(), reason="`sluice loadtest compare` not wired yet")
def test_cli_compare(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", make_rows(200, seed=1))
    b = write_run(tmp_path / "b", make_rows(200, seed=2))

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sluice.cli", "loadtest", "compare",
                               *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=120, check=False,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})

    done = cli(str(a), str(b), "--out", str(tmp_path / "x"), "--resamples", "200")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "x" / "compare.html").is_file()
    missing = cli(str(a), str(tmp_path / "nope"), "--out", str(tmp_path / "y"))
    assert missing.returncode == 2 and "nope" in missing.stderr
