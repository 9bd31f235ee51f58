"""Smoke test of the engine bench: every piece runs on a tiny config and yields every key.

No timing is asserted (ratios on a shared CI machine are not a pass/fail signal); the
bench itself prints and checks targets.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from backend.bench import __main__ as bench_main
from backend.bench import matmul
from backend.bench.checkpoint import TEST_MODEL
from backend.bench.settings import TEST
from backend.bench.workload import (
    WorkloadSpec,
    make_requests,
    percentile,
    with_arrivals,
)
from backend.engine.decode_kernel import load_decode_kernel
from backend.engine.fused_decode import MAX_ROWS
from tests.backend.engine.conftest import cpu_has_avx2_fma, no_compiler, no_fused_step

TARGET_KEYS = (
    "continuous_vs_static_tokens_per_s",
    "static_over_continuous_p99_ttft",
    "continuous_vs_hf_generate_tokens_per_s",
    "decode_step_over_roofline",
    "prefix_cache_ttft_speedup",
    "concurrency_ttft_p99_over_p50",
    "concurrency_burst_ttft_over_bound",
    "concurrency_steady_ttft_p99_over_p50",
)


def test_workload_is_seeded_and_within_bounds() -> None:
    spec = WorkloadSpec(200, (16, 1024), (8, 512), (4, 1024))
    a, b = make_requests(spec, seed=3), make_requests(spec, seed=3)
    assert a == b
    assert a != make_requests(spec, seed=4)
    assert all(16 <= len(r.prompt_token_ids) <= 1024 and 8 <= r.max_tokens <= 512 for r in a)
    assert all(4 <= t < 1024 for r in a for t in r.prompt_token_ids)
    # log-uniform: the median is far below the midpoint (heavy tail)
    assert percentile([len(r.prompt_token_ids) for r in a], 50) < 300
    timed = with_arrivals(a, rate=10.0, seed=1)
    arrivals = [r.arrival for r in timed]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert 10 < arrivals[-1] < 30  # 199 gaps of mean 0.1 s


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile(list(map(float, range(101))), 99) == 99.0
    assert math.isnan(percentile([], 50))


def test_bench_cli_writes_every_key_finite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    monkeypatch.setattr(bench_main, "QUICK", TEST)
    out = tmp_path / "bench.json"
    assert bench_main.main(["--quick", "--dtype", "float32", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    for key in TARGET_KEYS:
        assert key in data, key
    roof = data["decode_step_over_roofline"]
    assert set(roof) == {"1", "8", "32"}
    values = [data[k] for k in TARGET_KEYS if k != "decode_step_over_roofline"]
    values += list(roof.values())
    for v in values:
        assert isinstance(v, float) and math.isfinite(v) and v > 0, data
    details = data["details"]
    assert details["runs"]["continuous"]["output_tokens"] == \
        details["workload"]["output_tokens"]
    for b, ratio in roof.items():  # the figure is the median of paired rounds' ratios
        rounds = details["decode_steps"][b]["round_ratios"]
        assert len(rounds) == TEST.roofline_rounds
        assert ratio == statistics.median(rounds)
    assert details["runs"]["concurrency"]["output_tokens"] == \
        TEST.concurrency_requests * TEST.concurrency_output_len
    table = capsys.readouterr().out
    assert "continuous vs static" in table and "roofline" in table
    assert "closed-loop streams" in table


def test_matmul_bench_times_the_three_kernels_of_every_step_matmul(tmp_path: Path) -> None:
    """``python -m backend.bench.matmul`` on the test model: every row count gets the three
    sides, over all of a decode step's matmuls (their FLOPs are the model's)."""
    if load_decode_kernel() is None:
        no_compiler()
    if not cpu_has_avx2_fma():
        no_fused_step()
    out = tmp_path / "matmul.json"
    assert matmul.main(["--model", "test", "--rows", "1,12,20", "--rounds", "2",
                        "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["details"]["flops_per_row"] == 2 * TEST_MODEL.matmul_params
    assert data["details"]["matmuls"] == 4 * TEST_MODEL.num_layers + 1
    assert set(data["rows"]) == set(data["c_row_over_c"]) == set(data["onednn_over_c"]) \
        == {"1", "12", "20"}
    for n, row in data["rows"].items():
        for side in matmul.SIDES:
            ms, gflops = row[f"{side}_ms"], row[f"{side}_gflops"]
            assert 0 < ms < 10_000 and math.isfinite(gflops)
            assert gflops == pytest.approx(data["details"]["flops_per_row"] * int(n) / ms / 1e6)
        assert data["c_row_over_c"][n] > 0 and data["onednn_over_c"][n] > 0


@pytest.mark.parametrize("argv", [["--rows", "0"], ["--rows", f"{MAX_ROWS + 1}"],
                                  ["--rows", "a"], ["--rows", ""], ["--rounds", "0"]])
def test_matmul_bench_refuses_bad_arguments(argv: list[str],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        matmul.main(["--model", "test", *argv])
    assert exc.value.code == 2
    assert "--r" in capsys.readouterr().err


def test_the_concurrency_tail_splits_the_burst_from_the_rest() -> None:
    from backend.bench.concurrency import tail
    from backend.bench.workload import RunStats

    run = RunStats("cc", 100, 1.0, [0.1, 0.2, 0.4, 0.8] + [0.05] * 10 + [0.1])
    t = tail(run, streams=4, prompt_len=100, rate=1000.0)
    assert t.burst_slowest_s == 0.8 and t.burst_bound_s == 0.4
    assert t.burst_over_bound == 2.0
    assert t.steady_p50_s == 0.05 and math.isclose(t.steady_p99_s, 0.095)
