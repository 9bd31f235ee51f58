"""``python -m backend.bench.fork`` on a short prompt: its figures are consistent (no timed
asserts: the TTFT ratio is the benchmark's to report, not the suite's)."""

from __future__ import annotations

from pathlib import Path

from backend.bench.fork import format_report, run
from backend.engine.builder import build_engine
from backend.engine.config import EngineConfig


def test_the_fork_bench_reports_one_prefill_and_shared_blocks(tiny_cache_dir: Path) -> None:
    parts = build_engine(EngineConfig(model="tiny", cache_dir=str(tiny_cache_dir),
                                      device="cpu", block_size=16))
    r = run(parts, prompt_len=100, n=3, tokens=5, rounds=1, seed=1)
    assert r["prompt_tokens_computed"] == {"1": 100, "3": 100}
    assert r["kv_blocks_held"]["3"] == r["kv_blocks_expected"] == 6 + 3 * 1
    assert r["kv_blocks_unshared"] == 3 * 7
    assert r["ttft_ratio"] > 0
    report = format_report(r)
    assert "PASS: prefilled once" in report and "FAIL" not in report.split("\n")[2]
