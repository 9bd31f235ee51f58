"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a flat, paged batch.

Parameters carry Hugging Face names (``model.layers.0.self_attn.q_proj.weight`` …), so
``named_parameters()`` / ``state_dict()`` line up with a safetensors checkpoint by name.
For speed q/k/v and gate/up run as one matmul each: their HF-named parameters are views
into one fused tensor per layer (``_Fused``), so loading into ``q_proj.weight`` fills the
fused ``qkv_weight`` in place and no second copy of the weights exists.

``quantize`` (``quant.py``) replaces every matrix, the embedding and the LM head by a
quantized copy and frees the floating-point one (its parameters become empty tensors); the
matmul slots that hold oneDNN-packed copies in a floating-point model hold the quantized
matmuls instead (C on the CPU, torch ops elsewhere).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from modelfiles.model_config import ModelConfig

from ..attention import (
    AttentionBatch,
    PagedDecodeKernel,
    Workspace,
    paged_attention,
    write_kv,
)
from ..fused_decode import MAX_ROWS as FUSED_MAX_ROWS
from ..fused_decode import FusedDecoder
from ..quant import QuantizedWeight
from ..weights import DecoderWeights, LayerWeights, Matrix, PackedLayer, PackedMatmul
from .linear import HALF_MAX_ROWS, PackedLinear, linear
from .llama_quant import bind_quantized_matmuls, quantize_model, weight_bytes


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """Uninitialised parameter: the loader (or ``init_weights``) fills every one."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class _Proj(nn.Module):
    """An HF-named linear; its weight/bias may alias a slice of a fused tensor."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self) -> None:
        super().__init__()
        self.register_parameter("bias", None)


class _Fused(nn.Module):
    """Owns fused buffers and re-aliases the HF-named part parameters onto them.

    ``_fused`` maps a buffer prefix ("qkv") to its parts [("q_proj", rows), ...]; the
    buffers ``<prefix>_weight`` (and ``<prefix>_bias``) are the only real storage.
    """

    _fused: dict[str, list[tuple[str, int]]]

    def _make_fused(self, prefix: str, parts: list[tuple[str, int]], in_features: int,
                    bias: bool, dtype: torch.dtype, device: torch.device) -> None:
        rows = sum(n for _, n in parts)
        self.register_buffer(f"{prefix}_weight",
                             torch.empty(rows, in_features, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer(f"{prefix}_bias",
                             torch.empty(rows, dtype=dtype, device=device) if bias else None,
                             persistent=False)
        for name, _ in parts:
            setattr(self, name, _Proj())
        self._fused[prefix] = parts
        self._bind()

    def _bind(self) -> None:
        for prefix, parts in self._fused.items():
            weight, bias = getattr(self, f"{prefix}_weight"), getattr(self, f"{prefix}_bias")
            offset = 0
            for name, rows in parts:
                part = getattr(self, name)
                part.weight = nn.Parameter(weight[offset:offset + rows], requires_grad=False)
                if bias is not None:
                    part.bias = nn.Parameter(bias[offset:offset + rows], requires_grad=False)
                offset += rows

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> _Fused:
        # .to()/.half() convert buffers and parameters separately, which would break the
        # aliasing; rebuild the part views from the converted fused buffers.
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]  # torch: unannotated
        self._bind()
        return self


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _param((size,), dtype, device)
        self.eps = eps
        self.weight32: torch.Tensor | None = None  # for float32 activations of a half model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Fused kernel; accumulates the mean square in float32 for half inputs.
        w: torch.Tensor = self.weight
        if x.dtype != w.dtype:
            if self.weight32 is None:
                self.weight32 = w.float()
            w = self.weight32
        return F.rms_norm(x, w.shape, w, self.eps)


class RotaryEmbedding(nn.Module):
    """RoPE with HF's exact inverse frequencies (default, linear, llama3)."""

    inv_freq: torch.Tensor
    sin_sign: torch.Tensor

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (
            torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
        scaling = config.rope_scaling
        if scaling is not None and scaling.rope_type == "linear":
            inv_freq = inv_freq / scaling.factor
        elif scaling is not None and scaling.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling.factor, scaling.low_freq_factor,
                                        scaling.high_freq_factor,
                                        scaling.original_max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        half = dim // 2
        # rotate_half(x) = cat(-x2, x1) = roll(x, half) * [-1]*half ++ [1]*half
        sign = torch.cat([-torch.ones(half), torch.ones(half)])
        self.register_buffer("sin_sign", sign.to(device), persistent=False)
        self.half_dim = half

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, signed sin as [T, 1, head_dim] in ``dtype``; computed once per step."""
        freqs = positions.unsqueeze(1).float() * self.inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(dtype).unsqueeze(1)
        sin = (emb.sin().to(dtype) * self.sin_sign.to(dtype)).unsqueeze(1)
        return cos, sin

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] -> x*cos + rotate_half(x)*sin (HF's formula)."""
        return torch.addcmul(x * cos, torch.roll(x, self.half_dim, dims=-1), sin)


def _llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                     high_freq_factor: float, old_context_len: int) -> torch.Tensor:
    """transformers' ``_compute_llama3_parameters``, op for op."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


@dataclass(slots=True)
class _Step:
    """What every layer needs for one forward pass, computed once per step."""

    rope: RotaryEmbedding
    cos: torch.Tensor
    sin: torch.Tensor
    batch: AttentionBatch
    ws: Workspace
    kernel: PagedDecodeKernel | None


class LlamaAttention(_Fused):
    qkv_weight: torch.Tensor  # [q + 2 kv, hidden]: q_proj, k_proj, v_proj alias its rows
    qkv_bias: torch.Tensor | None

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self._fused = {}
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        q, kv = config.q_size, config.kv_size
        self._make_fused("qkv", [("q_proj", q), ("k_proj", kv), ("v_proj", kv)],
                         config.hidden_size, config.attention_bias, dtype, device)
        self.o_proj = _Proj()
        self.o_proj.weight = _param((config.hidden_size, q), dtype, device)
        self.qkv_packed: PackedMatmul | None = None  # see prepack_cpu_matmuls, quantize
        self.o_packed: PackedMatmul | None = None
        self.qkv_quant: QuantizedWeight | None = None  # see LlamaForCausalLM.quantize
        self.o_quant: QuantizedWeight | None = None
        if config.o_proj_bias:
            self.o_proj.bias = _param((config.hidden_size,), dtype, device)

    def forward(self, x: torch.Tensor, step: _Step, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        t, ws = x.shape[0], step.ws
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(x, self.qkv_weight, self.qkv_bias, self.qkv_packed)
        # q and k are adjacent columns, so one rotary pass covers both.
        qk = step.rope.rotate(qkv[:, :(h + hkv) * d].view(t, h + hkv, d), step.cos, step.sin)
        q, k = qk[:, :h], qk[:, h:]
        v = qkv[:, (h + hkv) * d:].view(t, hkv, d)
        if k.dtype != k_cache.dtype:  # float32 activations: K/V are stored (and used) rounded
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
        write_kv(k_cache, v_cache, k, v, step.batch)
        out = paged_attention(q, k, v, k_cache, v_cache, step.batch, self.scale, ws,
                              step.kernel)
        return linear(out, self.o_proj.weight, self.o_proj.bias, self.o_packed)


class LlamaMLP(_Fused):
    gate_up_weight: torch.Tensor  # [2 inter, hidden]: gate_proj, up_proj alias its rows

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self._fused = {}
        inter = config.intermediate_size
        self.inter = inter
        self._make_fused("gate_up", [("gate_proj", inter), ("up_proj", inter)],
                         config.hidden_size, False, dtype, device)
        self.down_proj = _Proj()
        self.down_proj.weight = _param((config.hidden_size, inter), dtype, device)
        self.gate_up_packed: PackedMatmul | None = None  # see prepack_cpu_matmuls, quantize
        self.down_packed: PackedMatmul | None = None
        self.gate_up_quant: QuantizedWeight | None = None  # see LlamaForCausalLM.quantize
        self.down_quant: QuantizedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_weight, None, self.gate_up_packed)
        act = F.silu(gate_up[:, :self.inter]).mul_(gate_up[:, self.inter:])
        return linear(act, self.down_proj.weight, None, self.down_packed)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, dtype, device)
        self.mlp = LlamaMLP(config, dtype, device)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)

    def forward(self, h: torch.Tensor, step: _Step, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        # h is owned by the forward pass (fresh per step), so residual adds go in place.
        h += self.self_attn(self.input_layernorm(h), step, k_cache, v_cache)
        h += self.mlp(self.post_attention_layernorm(h))
        return h

    def weights(self) -> LayerWeights:
        attn, mlp = self.self_attn, self.mlp
        packed = None
        if attn.qkv_packed is not None and attn.o_packed is not None \
                and mlp.gate_up_packed is not None and mlp.down_packed is not None:
            packed = PackedLayer(attn.qkv_packed, attn.o_packed, mlp.gate_up_packed,
                                 mlp.down_packed)
        return LayerWeights(
            qkv=attn.qkv_quant or attn.qkv_weight, qkv_bias=attn.qkv_bias,
            o=attn.o_quant or attn.o_proj.weight, o_bias=attn.o_proj.bias,
            gate_up=mlp.gate_up_quant or mlp.gate_up_weight,
            down=mlp.down_quant or mlp.down_proj.weight,
            input_norm=self.input_layernorm.weight,
            post_attention_norm=self.post_attention_layernorm.weight, packed=packed)


class _Embedding(nn.Module):
    weight: nn.Parameter

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _param((vocab, hidden), dtype, device)
        self.quant: QuantizedWeight | None = None  # see LlamaForCausalLM.quantize


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = _Embedding(config.vocab_size, config.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, dtype, device) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary_emb = RotaryEmbedding(config, device)

    @property
    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        return cast("list[LlamaDecoderLayer]", list(self.layers))


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head; forward() returns final-norm hidden states for every token."""

    lm_head: _Proj  # absent when the head is tied to the embedding

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.workspace = Workspace()  # scratch shared by all layers; one forward at a time
        self.model = LlamaModel(config, dtype, device)
        self.lm_head_packed: PackedMatmul | None = None
        self.quantization: str | None = None  # see quantize
        self._lm_head_quant: QuantizedWeight | None = None  # untied heads only
        self._weight_bytes: int | None = None  # see weight_bytes
        self.decode_kernel: PagedDecodeKernel | None = None  # see set_decode_kernel
        self.fused: FusedDecoder | None = None  # see set_decode_kernel
        if not config.tie_word_embeddings:
            self.lm_head = _Proj()
            self.lm_head.weight = _param((config.vocab_size, config.hidden_size), dtype, device)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                batch: AttentionBatch) -> torch.Tensor:
        """input_ids/positions [T] -> hidden [T, hidden]; writes the step's K/V."""
        m = self.model
        t, dec = input_ids.shape[0], batch.decode
        if self.fused is not None and dec is not None and not batch.prefills \
                and dec.token_range == (0, t) \
                and (t <= FUSED_MAX_ROWS or self.lm_head_packed is not None):
            # Every token decodes (``fused_decode.py``): few of them in one C call, more
            # with oneDNN's matmuls and C for everything between them.
            cos32, sin32 = m.rotary_emb.cos_sin(positions, torch.float32)
            tables = dec.block_ids.view(t, dec.blocks_per_seq)
            if t > FUSED_MAX_ROWS:
                return self.fused.forward_packed(input_ids, cos32, sin32, tables,
                                                 dec.context_lens, kv_caches)
            scratch = self.workspace.get("fused", (self.fused.scratch_numel(t),),
                                         torch.float32, input_ids.device)
            return self.fused.forward(input_ids, cos32, sin32, tables, dec.context_lens,
                                      kv_caches, scratch)
        quant = m.embed_tokens.quant
        if quant is not None:  # a quantized CPU model keeps its activations in float32
            cpu = input_ids.device.type == "cpu"
            h = quant.gather(input_ids, torch.float32 if cpu else self.dtype)
        else:
            h = F.embedding(input_ids, m.embed_tokens.weight)
        if self.lm_head_packed is not None and h.dtype != torch.float32 \
                and h.shape[0] > HALF_MAX_ROWS and quant is None:
            # Steps that multiply with the packed fp32 weights keep the activations in
            # float32: no half <-> fp32 conversion around every matmul, cheaper norms.
            h = h.float()
        cos, sin = m.rotary_emb.cos_sin(positions, h.dtype)
        step = _Step(m.rotary_emb, cos, sin, batch, self.workspace, self.decode_kernel)
        for layer, (k_cache, v_cache) in zip(m.layers, kv_caches, strict=True):
            h = layer(h, step, k_cache, v_cache)
        out: torch.Tensor = m.norm(h)
        return out

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab]."""
        if self.fused is not None and hidden.dtype == torch.float32 \
                and 1 <= hidden.shape[0] <= FUSED_MAX_ROWS and self.quantization is None:
            return self.fused.linear(hidden.contiguous(), self.lm_head_weight, None)
        return linear(hidden, self.lm_head_weight, None, self.lm_head_packed, torch.float32)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    @property
    def lm_head_matrix(self) -> Matrix:
        """The LM head as the model multiplies with it (quantized, or ``lm_head_weight``)."""
        if self.quantization is None:
            return self.lm_head_weight
        quant = self.model.embed_tokens.quant if self.config.tie_word_embeddings \
            else self._lm_head_quant
        if quant is None:
            raise RuntimeError("a quantized model without its quantized LM head")
        return quant

    def quantize(self, kind: str) -> None:
        """Quantize every matrix, the embedding and the LM head in place, freeing the
        floating-point ones (``llama_quant.py``)."""
        quantize_model(self, kind)
        self._weight_bytes = None
        self._rebind_fused()

    def weight_bytes(self) -> int:
        """Bytes of every tensor the model holds for its weights (``llama_quant.py``)."""
        if self._weight_bytes is None:
            self._weight_bytes = weight_bytes(self)
        return self._weight_bytes

    @torch.no_grad()
    def prepack_cpu_matmuls(self) -> None:
        """Keep a oneDNN-prepacked float32 copy of every matmul weight (CPU; see
        ``linear.py``). Costs one float32 copy of the matmul weights in memory. Half
        models then run steps of more than ``HALF_MAX_ROWS`` tokens with float32
        activations (K/V still stored in the model dtype). A quantized model keeps no
        copy: nothing to do."""
        if self.quantization is not None:
            return
        for layer in self.model.decoder_layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_packed = PackedLinear.pack(attn.qkv_weight, attn.qkv_bias)
            attn.o_packed = PackedLinear.pack(attn.o_proj.weight, attn.o_proj.bias)
            mlp.gate_up_packed = PackedLinear.pack(mlp.gate_up_weight, None)
            mlp.down_packed = PackedLinear.pack(mlp.down_proj.weight, None)
        self.lm_head_packed = PackedLinear.pack(self.lm_head_weight, None)
        if self.dtype != torch.float32:  # multi-row steps of half models run in fp32
            norms = [self.model.norm]
            for layer in self.model.decoder_layers:
                norms += [layer.input_layernorm, layer.post_attention_layernorm]
            for norm in norms:
                norm.weight32 = norm.weight.float()
        self._weight_bytes = None
        self._rebind_fused()  # the fused step's many-row path multiplies with the copies

    def decoder_weights(self) -> DecoderWeights:
        """The decoder's tensors (references, not copies) and shapes, for the C kernels."""
        cfg, m = self.config, self.model
        return DecoderWeights(
            layers=tuple(layer.weights() for layer in m.decoder_layers),
            embed=m.embed_tokens.quant or m.embed_tokens.weight, final_norm=m.norm.weight,
            lm_head=self.lm_head_matrix,
            hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
            lm_head_packed=self.lm_head_packed)

    def set_decode_kernel(self, kernel: PagedDecodeKernel | None, fused: bool = True) -> None:
        """Use ``kernel`` for decode attention where it supports the cache (the CPU's C
        kernel, CUDA's Triton one), and with
        ``fused``, its fused steps for steps where every sequence decodes, where it supports
        the model (``fused_decode.py``)."""
        self.decode_kernel = kernel
        self.fused = None
        if self.quantization is not None:
            bind_quantized_matmuls(self)
            self._weight_bytes = None
        if kernel is not None and fused:
            self.fused = kernel.fused_decoder(self.decoder_weights())

    def _rebind_fused(self) -> None:
        """A fused step in use is made again over the current weights: it holds their
        addresses (and dtype)."""
        if self.fused is not None and self.decode_kernel is not None:
            self.fused = self.decode_kernel.fused_decoder(self.decoder_weights())

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor],
               recurse: bool = True) -> LlamaForCausalLM:
        # .to(), .float(), .bfloat16() ... move the weights, so the fused step is made again.
        if self.quantization is not None:
            raise ValueError("a quantized model cannot be moved or converted: quantize it "
                             "where it is to run, in its dtype")
        self._weight_bytes = None
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]  # torch: unannotated
        self._rebind_fused()
        return self

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named standalone tensors (no shared storage), ready for safetensors."""
        if self.quantization is not None:
            raise ValueError("a quantized model has no floating-point weights to export")
        return {name: p.detach().clone().contiguous() for name, p in self.named_parameters()}

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random init (HF-like): N(0, std) matrices, unit norms, zero biases."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
