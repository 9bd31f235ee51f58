"""Weight-only quantization: the formats, quantize-at-load, and the torch reference.

Two formats, both symmetric (no zero point), both quantized from the floating-point
checkpoint when the engine loads it (``EngineConfig(quantization=...)``):

* ``int8``: one int8 per weight, one float32 scale per output row (per output channel):
  ``w[r, k] ~ q[r, k] * scale[r]``, ``scale[r] = max_k |w[r, k]| / 127``.
* ``int4``: one 4-bit value per weight, one float32 scale per group of ``GROUP`` (128)
  weights along the input dimension (the last group of a row may be shorter):
  ``w[r, k] ~ q[r, k] * scale[r, k // 128]``, q in -7..7, ``scale = max |w| / 7`` over the
  group. Stored two to a byte as ``q + 8``, in chunks of 16 weights per 8 bytes: byte j of
  a chunk holds weight j in its low nibble and weight j + 8 in its high nibble, so that one
  8-byte load, a mask and a shift give the chunk's two halves of 8 (``fused_decode.c``).
  Rows need ``K % 16 == 0``.

Every matrix the model multiplies with is quantized, the LM head included, and so is the
embedding (a gather of dequantized rows; on the bench model it is 29 % of the parameters),
in int8 for an int4 model whose head is not tied to it (``llama_quant.embedding_format``).
Norms and biases stay in the model dtype. A quantized model keeps no floating-point copy
of a quantized matrix (its parameters become empty tensors), and no oneDNN-packed copy
either. On the CPU it multiplies with the quantized bytes in C (``quant_kernels.c``:
dequantized in registers for few rows; per tile of 96 rows as exact bf16 integers for
the micro-kernel, scales applied to its sums, from 10 rows; from 128 rows a tile of rows
at a time in float32 for oneDNN, ``fused_decode.QuantizedMatmul``). Elsewhere (a GPU, no
compiler) ``QuantizedLinear`` dequantizes one matrix per call with torch ops and runs
``F.linear``.

``QuantizedWeight.dequantize`` is the reference every kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import QUANTIZATIONS
from .errors import InvalidRequestError

GROUP = 128  # int4: weights per scale, along the input dimension
CHUNK = 16  # int4: weights per 8-byte chunk (see the module docstring)
_INT8_MAX = 127
_INT4_MAX = 7


@dataclass(slots=True, frozen=True)
class QuantizedWeight:
    """A quantized [N, K] matrix: ``data`` (int8 [N, K], or uint8 [N, K / 2] for int4)
    and its float32 ``scale`` ([N] for int8, [N, ceil(K / GROUP)] for int4)."""

    kind: str
    data: torch.Tensor
    scale: torch.Tensor
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.data, self.scale)

    def is_contiguous(self) -> bool:
        return self.data.is_contiguous() and self.scale.is_contiguous()

    def integers(self) -> torch.Tensor:
        """The quantized values as int8 [N, K] (int4: unpacked, -7..7)."""
        if self.kind == "int8":
            return self.data
        n, k = self.shape
        chunks = self.data.view(n, k // CHUNK, CHUNK // 2)
        low = (chunks & 0x0F).to(torch.int8) - 8
        high = (chunks >> 4).to(torch.int8) - 8
        return torch.cat((low, high), dim=2).view(n, k)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [N, K] matrix the quantized values stand for (q * scale in float32, then
        ``dtype``): what every kernel must compute with."""
        q = self.integers().float()
        if self.kind == "int8":
            w = q * self.scale.unsqueeze(1)
        else:
            k = self.shape[1]
            groups = self.scale.repeat_interleave(GROUP, dim=1)[:, :k]
            w = q * groups
        return w if dtype == torch.float32 else w.to(dtype)

    def gather(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized rows ``ids`` [T] -> [T, K] (the embedding lookup)."""
        rows = QuantizedWeight(self.kind, self.data.index_select(0, ids),
                               self.scale.index_select(0, ids), (ids.shape[0], self.shape[1]))
        return rows.dequantize(dtype)


def quantize(weight: torch.Tensor, kind: str) -> QuantizedWeight:
    """Quantize a floating-point [N, K] matrix (on its device)."""
    if weight.dim() != 2:
        raise ValueError(f"quantize: a matrix [N, K] is needed, got {tuple(weight.shape)}")
    n, k = weight.shape
    w = weight.detach().float()
    if kind == "int8":
        scale = w.abs().amax(dim=1) / _INT8_MAX
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(w / safe.unsqueeze(1)).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
        return QuantizedWeight(kind, q.contiguous(), scale.contiguous(), (n, k))
    if kind != "int4":
        raise InvalidRequestError(f"unknown quantization {kind!r}; use one of "
                                  f"{', '.join(QUANTIZATIONS)}", "quantization")
    if k % CHUNK:
        raise InvalidRequestError(
            f"int4 quantization needs an input dimension divisible by {CHUNK}; a {n} x {k} "
            "matrix of this model is not", "quantization")
    groups = -(-k // GROUP)
    padded = F.pad(w, (0, groups * GROUP - k)).view(n, groups, GROUP)
    scale = padded.abs().amax(dim=2) / _INT4_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(padded / safe.unsqueeze(2)).clamp_(-_INT4_MAX, _INT4_MAX)
    nibbles = (q.view(n, groups * GROUP)[:, :k] + 8).to(torch.uint8).view(n, k // CHUNK, CHUNK)
    packed = nibbles[:, :, :CHUNK // 2] | (nibbles[:, :, CHUNK // 2:] << 4)
    return QuantizedWeight(kind, packed.reshape(n, k // 2).contiguous(), scale.contiguous(),
                           (n, k))


class QuantizedLinear:
    """x [rows, K] -> x W^T (+ bias) with torch ops: the matrix dequantized for the call, in
    x's dtype (a GPU, or a CPU without the C kernels). Peak extra memory: one matrix."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        return F.linear(x, self.weight.dequantize(x.dtype), bias)


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and aliases count once;
    an opaque oneDNN tensor counts its logical size)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors:
        if t.is_mkldnn:
            total += t.numel() * t.element_size()
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key not in seen and storage.nbytes():
            seen.add(key)
            total += storage.nbytes()
    return total
