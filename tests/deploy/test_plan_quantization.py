"""`sluice plan --quantization`: the quantized weights' exact bytes (the engine's own
count), and the unquantized fallback's plan beside the quantized one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modelfiles.model_config import ModelConfig
from sluice.cli import main
from sluice.plan import GIB, PlanInput, count_parameters, make_plan, quantized_weight_bytes

from .test_plan import LLAMA3_8B, QWEN25_05B


@pytest.fixture
def llama(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B))
    return path


def test_llama3_8b_int8_and_int4_bytes_by_hand() -> None:
    cfg = ModelConfig.from_hf(LLAMA3_8B)
    rows = 32 * (6144 + 4096 + 2 * 14336 + 4096) + 2 * 128256  # every matrix's rows
    norms = 32 * 2 * 4096 + 4096
    weights = count_parameters(cfg) - norms
    assert quantized_weight_bytes(cfg, "int8", "bf16") == weights + 4 * rows + 2 * norms
    # int4: the embedding stays int8 (128256 x 4096, a scale per row)
    embed = 128256 * 4096
    groups = 32 * (6144 * 32 + 4096 * 32 + 2 * 14336 * 32 + 4096 * 112) + 128256 * 32
    assert quantized_weight_bytes(cfg, "int4", "bf16") == (
        (weights - embed) // 2 + 4 * groups + embed + 4 * 128256 + 2 * norms)
    # tied embeddings are stored once
    qwen = ModelConfig.from_hf(QWEN25_05B)
    assert quantized_weight_bytes(qwen, "int8", "bf16") < 0.53 * count_parameters(qwen) * 2


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_the_plan_counts_what_the_engine_holds(kind: str, tiny_model_dir: Path) -> None:
    """The tiny checkpoint quantized by the engine (float32: no norm copies) holds exactly
    the bytes the planner computes."""
    import torch

    from backend.engine.loader import load_model

    model = load_model(tiny_model_dir, torch.float32, "cpu").model
    model.quantize(kind)
    cfg = ModelConfig.from_dir(tiny_model_dir)
    assert model.weight_bytes() == quantized_weight_bytes(cfg, kind, "fp32")


def test_text_output_sets_the_fallback_beside_the_quantized_plan(
        llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--model", str(llama), "--gpu-memory", "24GiB", "--quantization", "int8"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "weights: 8,030,261,248 parameters, int8 per output channel (float32 scales), " \
           "norms and biases bf16 = 7.49 GiB = 8,037,058,560 B" in out
    assert "KV per token (bf16)" in out  # the KV cache keeps the model dtype
    assert "unquantized fallback (bf16 weights): 14.96 GiB = 16,060,522,496 B" in out
    assert "max concurrent sequences at 8,192 tokens: int8 14, fallback 6 (2.33x)" in out


def test_json_has_both_plans(llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--model", str(llama), "--gpu-memory", "24GiB", "--quantization",
               "int4", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert rc == 0 and plan["quantization"] == "int4" and plan["kv_dtype"] == "bf16"
    fallback = plan["fallback"]
    assert fallback["weight_bytes"] == 16_060_522_496 and fallback["fits"] is True
    assert plan["kv_blocks"] > 2 * fallback["kv_blocks"]
    assert plan["max_sequences_at_context"] == 17 and fallback["max_sequences_at_context"] == 6


def test_the_fallback_may_not_fit_where_the_quantized_model_does(
        llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = ModelConfig.from_hf(LLAMA3_8B)
    inp = PlanInput(gpu_bytes=16 * GIB, quantization="int4", context=8192)
    assert make_plan(cfg, inp).fits and not make_plan(cfg, PlanInput(16 * GIB)).fits
    rc = main(["plan", "--model", str(llama), "--gpu-memory", "16GiB", "--quantization", "int4"])
    out = capsys.readouterr().out
    assert rc == 0 and "fallback 0 (the fallback fits none)" in out


@pytest.mark.parametrize("argv", [["--quantization", "int3"],
                                  ["--quantization", "int8", "--dtype", "int4"]])
def test_bad_quantization_input_exits_2(llama: Path, capsys: pytest.CaptureFixture[str],
                                        argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:  # argparse's choices, or the planner's check
        rc = main(["plan", "--model", str(llama), "--gpu-memory", "80GiB", *argv])
        raise SystemExit(rc)
    assert exc.value.code == 2
    assert "quantization" in capsys.readouterr().err
