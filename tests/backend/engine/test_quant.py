"""Weight quantization: the formats (round trip bounds, the int4 layout), the C matmuls
against the torch reference of the dequantized matrix, and a quantized model's fused and
torch paths against each other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from backend.engine import fused_decode
from backend.engine.decode_kernel import DecodeKernel
from backend.engine.errors import InvalidRequestError
from backend.engine.fused_decode import DEQUANT_MIN_ROWS, MAX_ROWS
from backend.engine.loader import load_model
from backend.engine.models.linear import PackedLinear
from backend.engine.quant import GROUP, QuantizedLinear, QuantizedWeight, quantize
from tests.backend.engine.conftest import no_fused_step
from tests.backend.engine.conftest_models import PagedRunner, save_hf_checkpoint

KINDS = ["int8", "int4"]


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.02
    w[3] = 0.0  # an all-zero row: scale 0, no division by it
    w[5, 7] = 0.5  # an outlier: its row's (group's) scale follows it
    return w


@pytest.mark.parametrize("k", [64, 176, 320])
def test_int8_round_trip_is_within_half_a_step_per_row(k: int) -> None:
    w = _weight(40, k, k)
    q = quantize(w, "int8")
    assert q.data.dtype == torch.int8 and q.data.shape == (40, k) and q.scale.shape == (40,)
    assert int(q.data.abs().max()) <= 127
    torch.testing.assert_close(q.scale, w.abs().amax(dim=1) / 127)
    err = (q.dequantize() - w).abs()
    assert bool((err <= q.scale.unsqueeze(1) / 2 + 1e-7).all())
    assert q.dequantize()[3].abs().max() == 0
    assert q.nbytes == 40 * k + 40 * 4


@pytest.mark.parametrize("k", [64, 176, 320])
def test_int4_round_trip_is_within_half_a_step_per_group(k: int) -> None:
    w = _weight(40, k, k + 1)
    q = quantize(w, "int4")
    groups = -(-k // GROUP)
    assert q.data.dtype == torch.uint8 and q.data.shape == (40, k // 2)
    assert q.scale.shape == (40, groups)
    ints = q.integers()
    assert int(ints.min()) >= -7 and int(ints.max()) <= 7
    step = q.scale.repeat_interleave(GROUP, dim=1)[:, :k]
    err = (q.dequantize() - w).abs()
    assert bool((err <= step / 2 + 1e-7).all())
    # the outlier only coarsens its own group
    assert float(q.scale[5, 0]) == pytest.approx(0.5 / 7)
    if groups > 1:
        assert float(q.scale[5, 1]) < 0.1 / 7
    assert q.nbytes == 40 * k // 2 + 40 * groups * 4


def test_int4_layout_is_chunks_of_16_low_then_high_nibbles() -> None:
    # weights -7..7 then 0: a chunk's byte j holds weight j (low) and j + 8 (high), + 8
    w = torch.tensor([[float(v) for v in range(-7, 8)] + [0.0]])
    q = quantize(w, "int4")
    assert float(q.scale[0, 0]) == 1.0
    expect = [(lo + 8) | ((hi + 8) << 4) for lo, hi in zip(range(-7, 1), [*range(1, 8), 0],
                                                           strict=True)]
    assert q.data[0].tolist() == expect
    assert q.integers()[0].tolist() == [*range(-7, 8), 0]


def test_int4_needs_k_divisible_by_16() -> None:
    with pytest.raises(InvalidRequestError, match="divisible by 16"):
        quantize(torch.randn(4, 40), "int4")
    with pytest.raises(InvalidRequestError, match="int8, int4"):
        quantize(torch.randn(4, 32), "int2")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 5, 10, 33, 64, 100, DEQUANT_MIN_ROWS + 72])
def test_c_matmul_equals_the_dequantized_reference(kernel: DecodeKernel, kind: str,
                                                   rows: int) -> None:
    """Every row count the fused steps and the prefill use (dot kernel < 10 rows, the
    per-tile path above, leftovers both ways; C still past DEQUANT_MIN_ROWS for matrices
    this small), N = 200 (not a multiple of a thread's 24), K = 176 and 320 (a partial
    int4 group), biases in float32 and bf16."""
    for k in (176, 320):
        w = _weight(200, k, rows * k)
        q = quantize(w, kind)
        ref_w = q.dequantize().double()
        gen = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, k, generator=gen)
        bias = torch.randn(200, generator=gen)
        for b in (None, bias, bias.bfloat16()):
            matmul = kernel.quantized_matmul(q, b)
            if matmul is None:
                no_fused_step()
            ref = x.double() @ ref_w.T + (0 if b is None else b.double())
            got = matmul(x)
            assert got.dtype == torch.float32 and got.shape == (rows, 200)
            torch.testing.assert_close(got, ref.float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_many_rows_go_through_float32_tiles(kernel: DecodeKernel, kind: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """From DEQUANT_MIN_ROWS rows (for matrices of DEQUANT_MIN_WEIGHTS, here any): the
    matrix in tiles of rows (here 64 rows a tile: 4 tiles, the last one short), each
    dequantized, reordered for oneDNN and multiplied; the C way gives the same."""
    monkeypatch.setattr(fused_decode, "TILE_BYTES", 64 * 4 * 320)
    monkeypatch.setattr(fused_decode, "DEQUANT_MIN_WEIGHTS", 0)
    q = quantize(_weight(200, 320, 9), kind)
    x, bias = torch.randn(DEQUANT_MIN_ROWS, 320), torch.randn(200)
    matmul = kernel.quantized_matmul(q, bias.bfloat16())
    if matmul is None:
        no_fused_step()
    ref = (x.double() @ q.dequantize().double().T + bias.bfloat16().double()).float()
    for way in ("auto", "tiles", "c"):
        torch.testing.assert_close(matmul(x, way=way), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_torch_matmul_equals_the_dequantized_reference(kind: str) -> None:
    w, x = _weight(48, 64, 1), torch.randn(7, 64)
    q = quantize(w, kind)
    bias = torch.randn(48)
    ref = F.linear(x.double(), q.dequantize().double(), bias.double()).float()
    torch.testing.assert_close(QuantizedLinear(q, bias)(x), ref, rtol=1e-5, atol=1e-5)
    half = QuantizedLinear(q, bias.bfloat16())(x.bfloat16())  # the GPU path keeps x's dtype
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), ref, rtol=0.05, atol=0.05)


def _quantized(path: Path, kind: str, kernel: DecodeKernel | None,
               dtype: torch.dtype = torch.float32) -> Any:
    model: Any = load_model(path, dtype, torch.device("cpu")).model
    model.quantize(kind)
    model.prepack_cpu_matmuls()  # a no-op: nothing to pack
    model.set_decode_kernel(kernel)
    return model


def _steps(model: Any, config: Any, rows: int) -> list[torch.Tensor]:
    """Prefill ``rows`` sequences of 5 tokens, then two decode steps of all of them."""
    runner = PagedRunner(model, config, num_blocks=rows * 4 + 8)
    gen = torch.Generator().manual_seed(rows)
    prompts = torch.randint(0, 300, (rows, 7), generator=gen).tolist()
    out = [torch.cat(runner.step([(i, p[:5]) for i, p in enumerate(prompts)]))]
    for j in (5, 6):
        out += runner.step([(i, [p[j]]) for i, p in enumerate(prompts)])
    return out


@pytest.mark.parametrize(("model_kind", "kind"), [("qwen2", "int8"), ("llama_tied", "int4")])
def test_fused_steps_of_a_quantized_model_match_its_torch_path(
        tmp_path: Path, kernel: DecodeKernel, kind: str, model_kind: str) -> None:
    """One C call (1, 12 rows) and the many-row path (70 rows: C matmuls, C between)
    against the same quantized weights through torch ops (dequantized per call). The
    tied head (llama_tied) is the quantized embedding itself; qwen2 has q/k/v biases."""
    pytest.importorskip("transformers")
    save_hf_checkpoint(model_kind, tmp_path, seed=5)
    fast = _quantized(tmp_path, kind, kernel)
    if fast.fused is None:
        no_fused_step()
    slow = _quantized(tmp_path, kind, None)
    assert slow.fused is None and isinstance(slow.model.layers[0].mlp.down_packed,
                                             QuantizedLinear)
    for rows in (1, 12, MAX_ROWS + 6):
        for got, ref in zip(_steps(fast, fast.config, rows), _steps(slow, slow.config, rows),
                            strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_a_quantized_model_holds_no_floating_point_matrix(tmp_path: Path,
                                                          kernel: DecodeKernel,
                                                          kind: str) -> None:
    pytest.importorskip("transformers")
    save_hf_checkpoint("llama3", tmp_path, seed=6)
    plain: Any = load_model(tmp_path, torch.bfloat16, torch.device("cpu")).model
    plain.prepack_cpu_matmuls()
    model = _quantized(tmp_path, kind, kernel, torch.bfloat16)
    matrices = [p for name, p in model.named_parameters() if "norm" not in name]
    assert len(matrices) == 2 + 7 * 2 and all(p.numel() == 0 for p in matrices)
    slots = [model.lm_head_packed]
    for layer in model.model.decoder_layers:
        slots += [layer.self_attn.qkv_packed, layer.self_attn.o_packed,
                  layer.mlp.gate_up_packed, layer.mlp.down_packed]
    assert not any(isinstance(s, PackedLinear) for s in slots)
    w = model.decoder_weights()
    quants = [w.lm_head, *(m for lw in w.layers for m in lw.matmuls)]
    assert all(isinstance(q, QuantizedWeight) and q.kind == kind for q in quants)
    # an int4 model keeps its (untied) embedding in int8
    assert isinstance(w.embed, QuantizedWeight) and w.embed.kind == "int8"
    quants.append(w.embed)
    assert w.quantization == kind and w.dtype == torch.bfloat16
    small = sum(p.numel() * 2 for p in model.parameters())  # norms: bf16 + fp32 copies
    assert model.weight_bytes() == sum(q.nbytes for q in quants) + small * 3
    bf16 = sum(p.numel() * 2 for p in plain.parameters())
    assert plain.weight_bytes() > 2.5 * bf16  # bf16, and oneDNN's packed float32 copy
    # the tiny rows (K = 64, 128) pay 4 bytes of scale per row (int8) or group (int4)
    assert model.weight_bytes() / bf16 < (0.55 if kind == "int8" else 0.35)
    with pytest.raises(ValueError, match="cannot be moved"):
        model.float()
