"""`python -m backend.bench.spec` end to end on the test model: every cell and figure it
promises (performance is the bench's to show, never asserted here)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from backend.bench.spec import main


def test_the_bench_reports_every_cell(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "spec.json"
    assert main(["--model", "test", "--dtype", "float32", "--rounds", "1", "--batches", "1,2",
                 "--prompt", "24", "--output", "24", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    figures = json.loads(out.read_text())["figures"]
    cells = {"repetitive:ngram", "repetitive:ngram-forced", "free:draft", "free:draft-forced"}
    assert set(figures) == cells
    for cell in cells:
        assert cell in table
        assert set(figures[cell]) == {"1", "2"}
        for f in figures[cell].values():
            for key in ("tokens_per_s_ratio", "tpot_ratio", "tokens_per_s", "tpot_ms",
                        "plain_tpot_ms", "ttft_ms", "draft_share"):
                assert math.isfinite(f[key]) and f[key] >= 0, (cell, key)
            assert 0 <= f["acceptance_rate"] <= 1 and 1 <= f["tokens_per_step"] <= 5
    # the repetitive prompts give the n-gram drafter something to find
    assert figures["repetitive:ngram-forced"]["1"]["acceptance_rate"] > 0
