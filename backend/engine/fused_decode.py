"""A whole decode step of a small batch in one C call, on the CPU.

Why: a decode step of one sequence moves every weight once (80 MB for the bench model in
bf16) and does little else, so its floor is the time to stream the weights. Through torch
ops the bench model's step runs ~80 small ops per layer (norms, rotary halves, casts,
slices, residual adds) that together cost as much as the weight stream: ~2.5 ms of a
6 ms step. Here one call runs all layers inside one OpenMP region:

    h = embed[ids]                                       (fp32)
    per layer: x = rmsnorm(h); qkv = x W_qkv (+ b); rotary on q, k; K/V into the paged
               cache; attention (the decode kernel's task); h += att W_o (+ b);
               x = rmsnorm(h); g, u = x W_gate_up; h += (silu(g) * u) W_down
    out = rmsnorm(h)

Weights (bf16 or fp32) are read where they lie and widened in registers; activations,
norms and sums stay fp32 (as the multi-row path's prepacked fp32 matmuls do). Each matmul
splits its output rows between the threads, so each thread streams one contiguous slice
of the weight. ``linear`` is the same matmul alone (the LM head).

Used for steps where every sequence decodes and there are at most ``MAX_ROWS`` of them;
larger batches run oneDNN's prepacked matmuls (``linear.py``), with C between them.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from .quant import QuantizedWeight
from .sampler import torch_argmax
from .weights import DecoderWeights, Matrix

# Decode steps of up to this many sequences run all in C (``FusedDecoder.forward``); larger
# ones keep oneDNN's prepacked matmuls (``forward_packed``). One step's matmuls of the
# bench model (bf16, 2-core AVX2 CPU; ``python -m backend.bench.matmul``), C against
# oneDNN: 32 rows 16.3 against 21.7 ms, 48: 24.3 / 30.4, 64: 32.3 / 38.1. Beyond, timed
# once through the C entry point: 96 rows 46.6 / 51.8, 128: 62.4 / 66.2, 256: a tie.
MAX_ROWS = 64

# The C source, compiled by ``decode_kernel.load_decode_kernel`` after the attention kernel's;
# the quantized matmuls (``quant_kernels.c``) come after the fused steps that call them.
SOURCE = "".join(Path(__file__).with_name(name).read_text()
                 for name in ("fused_decode.c", "quant_kernels.c"))

# ``FusedModel.quant`` in C: how the matrices and the embedding are stored
_QUANT_CODES = {None: 0, "int8": 1, "int4": 2}

_LAYER_FIELDS = ("qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w", "down_w", "in_norm", "post_norm",
                 "k_cache", "v_cache", "qkv_s", "o_s", "gate_up_s", "down_s")


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in _LAYER_FIELDS]


class _Model(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_int64) for name in (
        "layers", "hidden", "inter", "heads", "kv_heads", "head_dim", "num_blocks",
        "block_size", "bf16")),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("embed", ctypes.c_void_p), ("final_norm", ctypes.c_void_p),
        ("layer", ctypes.POINTER(_Layer)), ("quant", ctypes.c_int64),
        ("embed_s", ctypes.c_void_p), ("embed_quant", ctypes.c_int64)]


def _ptr(t: torch.Tensor | QuantizedWeight | None) -> int | None:
    """A tensor's address; a quantized matrix's data (``_scale_ptr``: its scales)."""
    if isinstance(t, QuantizedWeight):
        return t.data.data_ptr()
    return None if t is None else t.data_ptr()


def _kind(t: torch.Tensor | QuantizedWeight) -> str | None:
    return t.kind if isinstance(t, QuantizedWeight) else None


def _scale_ptr(t: torch.Tensor | QuantizedWeight) -> int | None:
    return t.scale.data_ptr() if isinstance(t, QuantizedWeight) else None


def _fn(lib: ctypes.CDLL, name: str, *args: Any) -> Any:
    """A C function returning void; every one takes the thread count last."""
    fn = getattr(lib, name)
    fn.restype = None
    fn.argtypes = [*args, ctypes.c_int]
    return fn


def _check_step_inputs(n: int, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       tables: torch.Tensor, context_lens: torch.Tensor) -> None:
    """The C side reads these by address: each must be contiguous, on the CPU, of its
    dtype and shape (a strided view would be read as if it were not)."""
    for name, t, dtype in (("input_ids", input_ids, torch.int64), ("cos", cos, torch.float32),
                           ("sin", sin, torch.float32), ("tables", tables, torch.int64),
                           ("context_lens", context_lens, torch.int64)):
        if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu" \
                or t.shape[0] != n:
            raise ValueError(f"fused decode: {name} must be a contiguous CPU {dtype} tensor "
                             f"with {n} rows")


class FusedDecoder:
    """The fused step bound to one decoder's weights (and, at first use, its KV cache)."""

    def __init__(self, lib: ctypes.CDLL, weights: DecoderWeights) -> None:
        i64, ptr, model_p = ctypes.c_int64, ctypes.c_void_p, ctypes.POINTER(_Model)
        self._forward = _fn(lib, "fused_forward", model_p, i64, ptr, ptr, ptr, ptr, i64, ptr,
                            ptr, ptr)
        self._linear = _fn(lib, "fused_linear", ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64)
        self._rope_attend = _fn(lib, "fused_rope_attend", model_p, i64, ptr, i64, ptr, ptr,
                                ptr, i64, ptr, ptr)
        self._add_norm = _fn(lib, "fused_add_norm", ptr, ptr, i64, i64, ptr, ctypes.c_float,
                             i64, ptr)
        self._silu_mul = _fn(lib, "fused_silu_mul", ptr, i64, i64, ptr)
        self._argmax = _fn(lib, "argmax_rows", ptr, i64, i64, ptr)
        self.weights = weights
        self.dtype = weights.dtype
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._struct: _Model | None = None
        self._layers: ctypes.Array[_Layer] | None = None
        w = weights
        self._scratch_per_row = (2 * w.hidden_size + (w.num_heads + 2 * w.num_kv_heads)
                                 * w.head_dim + w.q_size + 3 * w.intermediate_size)

    @staticmethod
    def supports(weights: DecoderWeights) -> bool:
        """Whether the fused step can run this decoder (dtype, shapes, layout)."""
        w = weights
        heads, kv_heads = w.num_heads, w.num_kv_heads
        tensors: list[Matrix] = [w.embed, w.lm_head]
        for layer in w.layers:
            tensors += layer.matmuls
        # one storage format for every matrix the step multiplies with (the C struct has one
        # flag; the embedding has its own)
        kinds = {_kind(t) for t in tensors[1:]}
        return (w.dtype in (torch.bfloat16, torch.float32) and len(kinds) == 1
                and (_kind(w.embed) is None) == (kinds == {None})
                and w.device.type == "cpu"
                and w.head_dim % 16 == 0 and heads % kv_heads == 0
                and heads // kv_heads in (1, 2, 4, 8)
                and w.hidden_size % 8 == 0 and w.intermediate_size % 8 == 0
                and w.q_size % 8 == 0
                and all(t.is_contiguous() for t in tensors))

    def _bind(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> _Model:
        """The C struct: the weights' addresses (taken now; a model moved afterwards gets a
        new decoder, see ``LlamaForCausalLM._apply``) and this KV cache's."""
        if self._struct is not None and self._caches is kv_caches:
            return self._struct
        for k, v in kv_caches:
            if k.dtype != self.dtype or v.dtype != self.dtype or not k.is_contiguous() \
                    or not v.is_contiguous():
                raise ValueError("fused decode: the KV cache must be contiguous and in the "
                                 "model dtype")
        w = self.weights
        layers = (_Layer * w.num_layers)()
        for i, (lw, (k, v)) in enumerate(zip(w.layers, kv_caches, strict=True)):
            layers[i] = _Layer(
                _ptr(lw.qkv), _ptr(lw.qkv_bias), _ptr(lw.o), _ptr(lw.o_bias),
                _ptr(lw.gate_up), _ptr(lw.down), _ptr(lw.input_norm),
                _ptr(lw.post_attention_norm), _ptr(k), _ptr(v), _scale_ptr(lw.qkv),
                _scale_ptr(lw.o), _scale_ptr(lw.gate_up), _scale_ptr(lw.down))
        k0 = kv_caches[0][0]
        self._struct = _Model(
            w.num_layers, w.hidden_size, w.intermediate_size, w.num_heads, w.num_kv_heads,
            w.head_dim, k0.shape[1], k0.shape[2], int(self.dtype == torch.bfloat16),
            w.rms_norm_eps, w.head_dim ** -0.5, _ptr(w.embed), _ptr(w.final_norm), layers,
            _QUANT_CODES[w.quantization], _scale_ptr(w.embed), _QUANT_CODES[_kind(w.embed)])
        self._layers, self._caches = layers, kv_caches
        return self._struct

    def forward(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                tables: torch.Tensor, context_lens: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                scratch: torch.Tensor) -> torch.Tensor:
        """Decode step of n <= MAX_ROWS sequences (token i is sequence i); returns the
        final-normed hidden states [n, hidden] in float32.

        cos, sin: float32 [n, head_dim] (``RotaryEmbedding.cos_sin``); tables [n, width],
        context_lens [n] int64 (``DecodeGroup``); scratch: float32, at least
        ``scratch_numel(n)`` elements.
        """
        n = input_ids.shape[0]
        if not 1 <= n <= MAX_ROWS:
            raise ValueError(f"fused decode takes 1..{MAX_ROWS} sequences, got {n}")
        _check_step_inputs(n, input_ids, cos, sin, tables, context_lens)
        struct = self._bind(kv_caches)
        out = torch.empty((n, self.weights.hidden_size), dtype=torch.float32)
        self._forward(ctypes.byref(struct), n, input_ids.data_ptr(), cos.data_ptr(),
                      sin.data_ptr(), tables.data_ptr(), tables.shape[1],
                      context_lens.data_ptr(), out.data_ptr(), scratch.data_ptr(),
                      torch.get_num_threads())
        return out

    def scratch_numel(self, n: int) -> int:
        return n * self._scratch_per_row

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None, *, wide: bool = True) -> torch.Tensor:
        """x [n <= MAX_ROWS, K] float32 -> x weight^T (+ bias) [n, N] float32; weight (and
        bias) in the model dtype. ``wide=False`` keeps the dot kernel at every row count
        (the 6 x 16 micro-kernel otherwise takes 10 rows and more; ``backend.bench.matmul``
        times both)."""
        n, k = x.shape
        if x.dtype != torch.float32 or not x.is_contiguous() or not 1 <= n <= MAX_ROWS \
                or x.device.type != "cpu" or weight.device.type != "cpu" \
                or weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous() \
                or weight.dtype != self.dtype or k % 8 or (bias is not None and (
                    bias.dtype != self.dtype or bias.shape != weight.shape[:1]
                    or not bias.is_contiguous())):
            raise ValueError(f"fused linear: x must be contiguous float32 [1..{MAX_ROWS} rows, "
                             f"K], weight contiguous [N, K] in {self.dtype}, K % 8 == 0")
        y = torch.empty((n, weight.shape[0]), dtype=torch.float32)
        self._linear(x.data_ptr(), n, k, weight.data_ptr(), _ptr(bias), y.data_ptr(),
                     weight.shape[0], int(weight.dtype == torch.bfloat16), int(wide),
                     torch.get_num_threads())
        return y

    def forward_packed(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       tables: torch.Tensor, context_lens: torch.Tensor,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Decode step of more than ``MAX_ROWS`` sequences: the matmuls run oneDNN's
        prepacked float32 weights (``prepack_cpu_matmuls`` first; a quantized model's
        ``QuantizedMatmul``s, ``LlamaForCausalLM.quantize``), everything between them
        runs here, one call per piece: norms fused with the residual adds, rotary + K/V
        write + attention, silu * up. Same arguments and result as ``forward``."""
        w = self.weights
        _check_step_inputs(input_ids.shape[0], input_ids, cos, sin, tables, context_lens)
        struct = self._bind(kv_caches)
        threads = torch.get_num_threads()
        n, hidden, inter = input_ids.shape[0], w.hidden_size, w.intermediate_size
        if isinstance(w.embed, QuantizedWeight):
            h = w.embed.gather(input_ids)
        else:
            h = torch.nn.functional.embedding(input_ids, w.embed).float()
        x = torch.empty_like(h)
        att = torch.empty((n, w.q_size), dtype=torch.float32)
        act = torch.empty((n, inter), dtype=torch.float32)
        bf16, eps = int(self.dtype == torch.bfloat16), w.rms_norm_eps
        width, tables_p, ctx_p = tables.shape[1], tables.data_ptr(), context_lens.data_ptr()
        norms = w.norms
        self._add_norm(h.data_ptr(), None, n, hidden, norms[0].data_ptr(), eps, bf16,
                       x.data_ptr(), threads)
        for i, layer in enumerate(w.layers):
            packed = layer.packed
            if packed is None:
                raise ValueError("fused decode: steps of more than MAX_ROWS rows need the "
                                 "prepacked matmuls (prepack_cpu_matmuls)")
            qkv = packed.qkv(x)
            self._rope_attend(ctypes.byref(struct), i, qkv.data_ptr(), n, cos.data_ptr(),
                              sin.data_ptr(), tables_p, width, ctx_p, att.data_ptr(), threads)
            o = packed.o(att)
            self._add_norm(h.data_ptr(), o.data_ptr(), n, hidden,
                           layer.post_attention_norm.data_ptr(), eps, bf16,
                           x.data_ptr(), threads)
            gate_up = packed.gate_up(x)
            self._silu_mul(gate_up.data_ptr(), n, inter, act.data_ptr(), threads)
            down = packed.down(act)
            self._add_norm(h.data_ptr(), down.data_ptr(), n, hidden, norms[i + 1].data_ptr(),
                           eps, bf16, x.data_ptr(), threads)
        return x

    def argmax(self, logits: torch.Tensor) -> list[int]:
        """``logits.argmax(dim=-1).tolist()`` for finite float32 CPU logits [n, vocab]."""
        if logits.dtype != torch.float32 or logits.dim() != 2 or not logits.is_contiguous() \
                or logits.device.type != "cpu" or logits.shape[1] == 0:
            return torch_argmax(logits)
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self._argmax(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr(),
                     torch.get_num_threads())
        picks: list[int] = out.tolist()
        for i, tok in enumerate(picks):
            if tok < 0:  # a NaN row: torch's rule (the first NaN)
                picks[i] = int(logits[i].argmax())
        return picks


# From this many rows on, a quantized matmul dequantizes its matrix a tile of rows at a time
# into a float32 buffer (one call's scratch, about TILE_BYTES) and multiplies it with oneDNN
# (reordered for it), since oneDNN's large-matrix kernels outrun the C micro-kernel there.
# One step's matrices of the bench model, int8, 2 threads, AVX-512 CPU (`python -m
# backend.bench.quant --matmul-rows 128,512`, two runs): 128 rows 50.6 / 42.7 ms this way
# against 49.5 / 46.8 in C; 512 rows 153.6 / 138.9 against 213.2 / 206.7 (oneDNN on the
# prepacked float32 copy, which a quantized model does not keep: 120.3 / 113.1).
DEQUANT_MIN_ROWS = 128
# ... for matrices of at least this many weights: below, a tile's fixed cost (the reorder,
# a few Python calls) outweighs the gain (`--model test --matmul-rows 130 --rounds 1`, its
# 64-wide matrices: 1.82 ms in tiles against 0.39 ms in C)
DEQUANT_MIN_WEIGHTS = 1 << 18
TILE_BYTES = 4 << 20
_PACK_FOR_ROWS = 32  # oneDNN's reorder hint, as models/linear.py packs


class QuantizedMatmul:
    """x [n, K] -> x W^T (+ bias) [n, N] float32 for a quantized W, any n: in C (few rows:
    dequantized in registers; more: per tile of 96 rows, ``quant_kernels.c``), or from
    ``DEQUANT_MIN_ROWS`` rows, per float32 tile through oneDNN. A quantized model's matmuls
    outside the fused steps (prefill chunks, steps of many rows, the LM head)."""

    def __init__(self, lib: ctypes.CDLL, weight: QuantizedWeight,
                 bias: torch.Tensor | None) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._fn = _fn(lib, "fused_linear_q", ptr, i64, i64, ptr, ptr, i64, ptr, i64, ptr, i64)
        self._dequant = _fn(lib, "dequant_matrix", ptr, ptr, i64, i64, i64, i64, ptr)
        self._onednn = (torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
                        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
        if weight.device.type != "cpu" or not weight.is_contiguous() or weight.shape[1] % 8 \
                or (bias is not None and (bias.dtype not in (torch.bfloat16, torch.float32)
                                          or not bias.is_contiguous())):
            raise ValueError("quantized matmul: a contiguous CPU weight with K % 8 == 0 and "
                             "a contiguous bf16 or float32 bias")
        self.weight = weight
        self.bias = bias
        self._code = _QUANT_CODES[weight.kind]

    def __call__(self, x: torch.Tensor, *, way: str = "auto") -> torch.Tensor:
        """``way``: "auto" (by the rows, as above), or "c" / "tiles" (the bench's sides)."""
        if x.dtype != torch.float32:
            x = x.float()
        if not x.is_contiguous():
            x = x.contiguous()
        n, k = x.shape
        out_features, in_features = self.weight.shape
        if k != in_features:
            raise ValueError(f"quantized matmul: x has {k} columns, the weight {in_features}")
        if self._onednn and (way == "tiles" or (way == "auto" and n >= DEQUANT_MIN_ROWS
                                                and out_features * k >= DEQUANT_MIN_WEIGHTS)):
            return self._by_tiles(x)
        y = torch.empty((n, out_features), dtype=torch.float32)
        if n:
            b = self.bias
            self._fn(x.data_ptr(), n, k, self.weight.data.data_ptr(),
                     self.weight.scale.data_ptr(), self._code, _ptr(b),
                     int(b is not None and b.dtype == torch.bfloat16), y.data_ptr(),
                     out_features, torch.get_num_threads())
        return y

    def _by_tiles(self, x: torch.Tensor) -> torch.Tensor:
        """Tiles of rows dequantized to float32, reordered for oneDNN and multiplied."""
        out_features, k = self.weight.shape
        rows = min(out_features, max(64, TILE_BYTES // (4 * k) // 8 * 8))
        buf = torch.empty(rows * k, dtype=torch.float32)
        bias = None if self.bias is None else self.bias.float()
        if rows == out_features:
            return self._tile(x, 0, rows, buf, bias)
        y = torch.empty((x.shape[0], out_features), dtype=torch.float32)
        for r0 in range(0, out_features, rows):
            r1 = min(out_features, r0 + rows)
            y[:, r0:r1] = self._tile(x, r0, r1, buf, bias)
        return y

    def _tile(self, x: torch.Tensor, r0: int, r1: int, buf: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        w, k = self.weight, self.weight.shape[1]
        tile = buf[:(r1 - r0) * k].view(r1 - r0, k)
        self._dequant(w.data.data_ptr(), w.scale.data_ptr(), self._code, k, r0, r1,
                      tile.data_ptr(), torch.get_num_threads())
        packed = torch.ops.mkldnn._reorder_linear_weight(tile, _PACK_FOR_ROWS)
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, packed, None if bias is None else bias[r0:r1], "none", [], "")
        return y
