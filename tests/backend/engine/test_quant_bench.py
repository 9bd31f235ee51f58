"""`python -m backend.bench.quant` end to end on the test model: every figure it promises,
and its matmul mode (performance is the bench's to show, never asserted here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.bench.quant import main
from backend.engine.decode_kernel import load_decode_kernel
from tests.backend.engine.conftest import no_compiler


def test_the_bench_reports_every_figure(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "quant.json"
    assert main(["--model", "test", "--rounds", "1", "--prompts", "3", "--prompt", "8",
                 "--steps", "4", "--batches", "1,2", "--decode", "2", "--prefill", "16",
                 "--json", str(out)]) == 0
    table = capsys.readouterr().out
    for label in ("KL mean", "top-1 agreement", "greedy agreement", "weight bytes held",
                  "decode_b1 tokens/s", "decode_b2 tokens/s", "prefill tokens/s"):
        assert label in table
    result = json.loads(out.read_text())
    held = {k: v["weight_bytes"] for k, v in result["weights"].items()}
    assert held["none"] > held["int8"] > held["int4"] > 0
    for kind in ("int8", "int4"):
        q = result["quality"][kind]
        assert 0 <= q["kl_mean"] <= q["kl_p99"] and 0 <= q["top1_agreement"] <= 1
        assert 0 <= q["greedy_agreement_min"] <= q["greedy_agreement_mean"] <= 4
    assert set(result["speed"]) == {"decode_b1", "decode_b2", "prefill"}
    assert set(result["speed"]["prefill"]["ratio"]) == {"int8", "int4"}
    assert result["details"]["engine_versions"]["int8"].endswith("+int8")


def test_the_matmul_mode_times_every_way(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    if load_decode_kernel() is None:  # the bench's own kernel cache, as it runs
        no_compiler()
    out = tmp_path / "mm.json"
    assert main(["--model", "test", "--matmul-rows", "1,130", "--rounds", "1",
                 "--formats", "int8", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    # bf16_c where the CPU runs the fused steps (AVX2 + FMA)
    assert {"onednn", "int8", "int8_c", "int8_tiles"} <= set(result["1"]["ms"])
    assert result["130"]["reference"] == "onednn" and "bf16_c" not in result["130"]["ms"]
    assert "one step's matrices" in capsys.readouterr().out
