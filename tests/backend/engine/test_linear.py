"""The CPU matmul paths (oneDNN-prepacked fp32 weights, half GEMV, padded fp32) all
compute F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend.engine.models.linear import HALF_MAX_ROWS, PackedLinear, can_prepack, linear

pytestmark = pytest.mark.skipif(not can_prepack(torch.device("cpu")),
                                reason="this torch build has no oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 31, 32, 33, 200])
def test_packed_fp32_equals_plain_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 80, generator=gen)
    packed = PackedLinear.pack(w, b)
    ref = F.linear(x.double(), w.double(), b.double() if b is not None else None).float()
    for got in (linear(x, w, b, packed), linear(x, w, b, None)):
        assert got.dtype == torch.float32 and got.shape == (rows, 96)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 16])
def test_half_inputs_use_half_weights_for_few_rows_and_fp32_beyond(
        dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(64, 48, generator=gen) * 0.1).to(dtype)
    x = torch.randn(rows, 48, generator=gen).to(dtype)
    packed = PackedLinear.pack(w, None)
    got = linear(x, w, None, packed)
    assert got.dtype == dtype
    if rows <= HALF_MAX_ROWS:  # the half kernel, bit for bit
        assert torch.equal(got, F.linear(x, w))
    else:  # fp32 math on the widened weights, rounded once at the end (within one ulp)
        ref = F.linear(x.float(), w.float())
        torch.testing.assert_close(got.float(), ref, rtol=1e-2, atol=1e-3)
    logits = linear(x, w, None, packed, torch.float32)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2)
