"""The device check's script, run on the CPU with a small model: every section runs and
its figures are sane, so a broken script is found here, not in device time."""

from __future__ import annotations

import json
from pathlib import Path

from backend.bench.gpu_check import JSON_NAME, main


def test_the_gpu_check_runs_on_the_cpu(tmp_path: Path) -> None:
    code = main(["--out", str(tmp_path), "--device", "cpu", "--dtype", "float32",
                 "--model", "test", "--no-bench", "--quick"])
    report = json.loads((tmp_path / JSON_NAME).read_text())
    assert code == 0, report
    pre = report["preflight"]
    assert pre["tokens"] == 6 and pre["graphs"] is None  # no CUDA: no graphs
    parity = report["parity"]
    assert parity["top1_agree"] == 1.0
    assert parity["logits_max_abs_diff"] < 1e-3 * max(1.0, parity["logits_scale"])
    assert parity["greedy_identical"] == parity["prompts"] == 4
    syncs = report["syncs"]
    assert len(syncs["counted_reads_per_step"]) == syncs["steps"] == 3
    assert min(syncs["counted_reads_per_step"]) >= 1
    rows = report["roofline"]["batches"]
    assert set(rows) == {"1", "2"}
    for row in rows.values():
        assert row["step_ms_eager"] > 0 and row["step_ms_graphs"] > 0
        assert row["over_roofline_eager"] > 0 and row["graphs_speedup"] > 0
    assert report["roofline"]["graphs_captured"] is False  # no CUDA: no graphs
    assert "bench" not in report
