"""`sluice plan` against hand-computed values, the capacity lesson's example first."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from modelfiles.model_config import ModelConfig
from sluice.cli import main
from sluice.plan import (
    GIB,
    LengthMix,
    PlanError,
    PlanInput,
    count_parameters,
    kv_bytes_per_token,
    make_plan,
    parse_size,
)

# Llama-3-8B's shapes, written by hand: the lesson's 32 layers, 8 KV heads, head dim 128.
LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
}
# Qwen2.5-0.5B's shapes: q/k/v biases, tied embeddings.
QWEN25_05B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "vocab_size": 151936, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": True,
}
# A mixed workload in issue #7's format: 3/4 short chat (buckets), 1/4 long (pairs), of
# which half (9000 + 10 tokens) does not fit an 8192 context.
WORKLOAD = """\
duration_s: 60
arrival: {process: poisson, rate: 5}
classes:
  - name: chat
    share: 0.75
    lengths:
      buckets:
        - {input: 100, output: 20, weight: 1}
  - name: long
    share: 0.25
    lengths:
      pairs: [[1000, 500], [9000, 10]]
"""


@pytest.fixture
def llama(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B))
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_lessons_example_1_gib_per_sequence_and_20_gib_for_20() -> None:
    cfg = ModelConfig.from_hf(LLAMA3_8B)
    assert kv_bytes_per_token(cfg, 2) == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    plan = make_plan(cfg, PlanInput(gpu_bytes=80 * GIB, context=8192, sequences=20))
    assert plan.kv_bytes_per_sequence == GIB
    assert plan.sequences_kv_bytes == 20 * GIB
    assert plan.sequences_fit is True


def test_weights_pool_blocks_and_concurrency_by_hand(llama: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "--model", str(llama), "--gpu-memory", "80GiB", "--json")
    assert rc == 0
    plan = json.loads(out)
    assert plan["parameters"] == 8_030_261_248  # Llama-3-8B's published count
    assert plan["weight_bytes"] == 16_060_522_496  # x 2 bytes
    assert plan["usable_bytes"] == 77_309_411_328  # 80 GiB x 0.90
    assert plan["kv_pool_bytes"] == 77_309_411_328 - 16_060_522_496
    assert plan["block_bytes"] == 16 * 128 * 1024
    assert plan["kv_blocks"] == 61_248_888_832 // 2_097_152 == 29_205
    assert plan["context"] == 8192  # the model's max_position_embeddings by default
    assert plan["blocks_per_context_sequence"] == 512
    assert plan["rounding_tokens_at_context"] == 0
    assert plan["max_sequences_at_context"] == 29_205 // 512 == 57
    assert plan["fits"] is True


def test_text_output_names_the_lessons_figures(llama: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "--model", str(llama), "--gpu-memory", "80GiB", "--context",
                     "8192", "--sequences", "20", "--dtype", "bf16")
    assert rc == 0
    assert "KV per token (bf16): 2 x 32 x 8 x 128 x 2 B = 128.0 KiB = 131,072 B" in out
    assert "KV per sequence at 8,192 tokens: 1.00 GiB = 1,073,741,824 B" in out
    assert "KV for 20 unshared sequences at 8,192 tokens: 20.00 GiB" in out
    assert "max concurrent sequences at 8,192 tokens: 57" in out


def test_block_rounding_at_an_unaligned_context(llama: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "--model", str(llama), "--gpu-memory", "80GiB", "--context",
                     "1000", "--block-size", "64", "--kv-dtype", "fp8", "--json")
    assert rc == 0
    plan = json.loads(out)
    assert plan["kv_bytes_per_token"] == 65_536  # fp8: 1 byte per element
    assert plan["kv_bytes_per_sequence"] == 65_536 * 1000
    assert plan["blocks_per_context_sequence"] == 16  # ceil(1000 / 64)
    assert plan["rounding_tokens_at_context"] == 24  # 16 x 64 - 1000
    assert plan["kv_blocks"] == 61_248_888_832 // (64 * 65_536) == 14_602
    assert plan["max_sequences_at_context"] == 14_602 // 16 == 912


def test_workload_lengths_rounding_refusals_and_failover(
        llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workload = tmp_path / "mixed.yaml"
    workload.write_text(WORKLOAD)
    rc, out, _ = run(capsys, "--model", str(llama), "--gpu-memory", "80GiB", "--workload",
                     str(workload), "--replicas", "4", "--json")
    assert rc == 0
    plan = json.loads(out)
    # kept: chat 0.75 (120 tokens = 8 blocks), long 0.125 (1500 tokens = 94 blocks)
    assert plan["workload_refused_fraction"] == pytest.approx(0.125)
    assert plan["workload_mean_tokens"] == pytest.approx(277.5 / 0.875)
    assert plan["workload_mean_blocks"] == pytest.approx(17.75 / 0.875)
    assert plan["workload_rounding_fraction"] == pytest.approx(6.5 / 284)
    assert plan["max_sequences_at_workload"] == 1439  # floor(29205 x 0.875 / 17.75)
    assert plan["fleet_sequences"] == 4 * 1439
    assert plan["surviving_sequences"] == 3 * 1439
    assert plan["safe_sequences_per_replica"] == 3 * 1439 // 4 == 1079
    rc, text, _ = run(capsys, "--model", str(llama), "--gpu-memory", "80GiB", "--workload",
                      str(workload), "--replicas", "4")
    assert "12.5% of the workload's requests exceed 8,192 tokens and are refused" in text
    assert "keep each replica at or below 1,079 sequences (75%)" in text


def test_parameter_count_matches_the_tiny_checkpoint(tiny_model_dir: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with safe_open(str(tiny_model_dir / "model.safetensors"), framework="numpy") as f:
        stored = sum(f.get_tensor(name).size for name in f.keys())  # noqa: SIM118
    cfg = ModelConfig.from_dir(tiny_model_dir)
    assert count_parameters(cfg) == stored
    rc, out, _ = run(capsys, "--model", str(tiny_model_dir), "--gpu-memory", "1GiB",
                     "--dtype", "fp32", "--json")
    assert rc == 0
    assert json.loads(out)["weight_bytes"] == 4 * stored


def test_biases_and_tied_embeddings_are_counted() -> None:
    assert count_parameters(ModelConfig.from_hf(QWEN25_05B)) == 494_032_768


@pytest.mark.parametrize(("text", "value"), [
    ("80GiB", 80 * GIB), ("80gib", 80 * GIB), ("24G", 24 * GIB), ("80GB", 80 * 10**9),
    ("512MiB", 512 << 20), ("1.5TiB", 3 << 39), ("4096B", 4096), ("2 GiB", 2 * GIB),
])
def test_sizes(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["80", "GiB", "-1GiB", "0GiB", "80 parsecs", ""])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(PlanError):
        parse_size(text)


@pytest.mark.parametrize(("args", "message"), [
    (["--gpu-memory", "80"], "give a number and a unit"),
    (["--gpu-memory", "80GiB", "--block-size", "12"], "power of two"),
    (["--gpu-memory", "80GiB", "--context", "16384"], "exceeds the model's 8192 positions"),
    (["--gpu-memory", "80GiB", "--dtype", "fp6"], "unknown weight dtype"),
    (["--gpu-memory", "80GiB", "--kv-dtype", "int4"], "unknown KV dtype"),
    (["--gpu-memory", "80GiB", "--replicas", "0"], "--replicas must be >= 1"),
    (["--gpu-memory", "80GiB", "--gpu-utilization", "1.5"], "--gpu-utilization"),
    (["--gpu-memory", "80GiB", "--workload", "/nonexistent/w.yaml"], "--workload"),
])
def test_bad_input_exits_2(llama: Path, capsys: pytest.CaptureFixture[str],
                           args: list[str], message: str) -> None:
    rc, out, err = run(capsys, "--model", str(llama), *args)
    assert rc == 2
    assert message in err and out == ""


def test_bad_model_paths_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "--model", str(tmp_path / "nope"), "--gpu-memory", "8GiB")[0] == 2
    rc, _, err = run(capsys, "--model", str(tmp_path), "--gpu-memory", "8GiB")
    assert rc == 2 and "config.json not found" in err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    rc, _, err = run(capsys, "--model", str(bad), "--gpu-memory", "8GiB")
    assert rc == 2 and "cannot read it" in err
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    rc, _, err = run(capsys, "--model", str(gpt2), "--gpu-memory", "8GiB")
    assert rc == 2 and "unsupported architecture" in err


def test_weights_that_do_not_fit_exit_1(llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "--model", str(llama), "--gpu-memory", "16GiB")
    assert rc == 1  # 14.96 GiB of weights > 16 GiB x 0.90
    assert "DOES NOT FIT" in out


def test_length_mix_normalizes_and_refuses() -> None:
    mix = LengthMix.from_weighted([(10, 6, 3.0), (100, 0, 1.0)], context=50)
    assert mix.refused == pytest.approx(0.25)
    assert mix.mean_tokens() == 16
    assert mix.mean_blocks(16) == 1
    with pytest.raises(PlanError):
        LengthMix.from_weighted([(100, 0, 1.0)], context=50)
