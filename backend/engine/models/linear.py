"""Matmuls on the CPU: oneDNN-prepacked float32 weights.

Measured on the bench model's matmuls (AVX2 CPU without bf16 hardware, 2 threads, every
weight streamed from DRAM): ``F.linear`` with a plain float32 weight runs a GEMV at ~10 GB/s
and M = 2…32 rows at 40–60 % of the large-shape GFLOP/s; the same weight reordered once
into oneDNN's blocked layout (``mkldnn._reorder_linear_weight``) and multiplied with
``mkldnn._linear_pointwise`` is 1.6–2x faster at every row count from 1 to 512 (M = 32:
36 → 22 ms for the model, ~115 GFLOP/s). oneDNN refuses bf16 weights without AVX-512 /
AVX-NE-CONVERT, so the packed copy is always float32.

Half-precision models keep their half weights for steps of one or two rows: a half GEMV
moves half the bytes (3.0 ms against 7.7 ms for the bench model at one row), and at three
rows the two cost the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..weights import PackedMatmul

# The packed layout is chosen for this many rows; it serves every row count (measured:
# packing for 32 is within noise of the best packing at 1…512 rows).
PACK_FOR_ROWS = 32
# Half-precision inputs with fewer rows use the half weights (memory-bound GEMV).
HALF_MAX_ROWS = 2
# Plain fp32 GEMM (no packed copy) has a slow path at 2-3 rows: pad those to 4.
_PAD_ROWS = 4


def can_prepack(device: torch.device) -> bool:
    """Whether this torch build can prepack linear weights for ``device``."""
    mkldnn = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]  # torch leaves is_available unannotated
    return (device.type == "cpu" and mkldnn
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


@dataclass(slots=True, frozen=True)
class PackedLinear:
    """A float32 copy of ``weight`` (and ``bias``) in oneDNN's blocked layout."""

    weight: torch.Tensor  # opaque mkldnn tensor, logical shape [out, in]
    bias: torch.Tensor | None  # float32, dense

    @classmethod
    @torch.no_grad()
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear:
        w32 = weight.detach().float().contiguous()
        packed = torch.ops.mkldnn._reorder_linear_weight(w32, PACK_FOR_ROWS)
        b32 = bias.detach().float().contiguous() if bias is not None else None
        return cls(packed, b32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] float32 -> [rows, out] float32."""
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none",
                                                             [], "")
        return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedMatmul | None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the fastest kernel for ``x``'s rows.

    The result has ``out_dtype`` (default: ``x``'s dtype). A quantized model's ``weight``
    is empty and ``packed`` its quantized matmul (``llama_quant.py``), the only one.
    """
    # Conversions are skipped in Python when not needed: even a no-op .to() costs a
    # dispatcher round trip (~1 us), and a decode step runs ~40 of these.
    rows = x.shape[0]
    dtype = out_dtype or x.dtype
    if packed is not None and not weight.numel():
        y = packed(x)
    elif packed is not None and (x.dtype == torch.float32 or rows > HALF_MAX_ROWS):
        if x.dtype != torch.float32:
            x = x.float()
        elif not x.is_contiguous():
            x = x.contiguous()
        y = packed(x)
    elif 1 < rows < _PAD_ROWS and x.dtype == torch.float32 and x.device.type == "cpu":
        padded = x.new_zeros((_PAD_ROWS, x.shape[1]))
        padded[:rows] = x
        y = F.linear(padded, weight, bias)[:rows]
    else:
        y = F.linear(x, weight, bias)
    return y if y.dtype == dtype else y.to(dtype)
