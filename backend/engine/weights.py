"""The decoder's tensors as plain values: what the C kernels read, and nothing else.

A model builds one ``DecoderWeights`` (``LlamaForCausalLM.decoder_weights``) from its
modules; the fused decode step (``fused_decode.py``) and the matmul bench consume it, so
they never walk a model's module tree. It holds references, not copies: a model whose
tensors move (``.to()``, a dtype change) builds a new one, and with it a new fused step,
since the C side keeps the tensors' addresses.

Layout (HF's, with q/k/v and gate/up fused into one matrix each):

    embed        [vocab, hidden]
    per layer:   qkv [q + 2 kv, hidden] (+ bias)   o [hidden, q] (+ bias)
                 gate_up [2 inter, hidden]         down [hidden, inter]
                 input_norm, post_attention_norm [hidden]
    final_norm   [hidden]
    lm_head      [vocab, hidden] (the embedding itself when tied)

A quantized model (``LlamaForCausalLM.quantize``) has every matrix, the embedding and the
LM head as ``QuantizedWeight``s (one format, ``quantization``, for all but an int4 model's
untied embedding, which is int8: ``llama_quant.embedding_format``); norms and biases stay
tensors in the model dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .quant import QuantizedWeight

# A matrix as the model holds it: in the model dtype, or quantized.
Matrix = torch.Tensor | QuantizedWeight

# A oneDNN-prepacked float32 matmul (``models.linear.PackedLinear``), or a quantized one
# (``fused_decode.QuantizedMatmul``, ``quant.QuantizedLinear``): x [n, in] -> [n, out].
PackedMatmul = Callable[[torch.Tensor], torch.Tensor]


@dataclass(slots=True, frozen=True)
class PackedLayer:
    """oneDNN-prepacked float32 copies of one layer's four matmuls (steps of many rows
    multiply with these; see ``models/linear.py``), or a quantized model's matmuls."""

    qkv: PackedMatmul
    o: PackedMatmul
    gate_up: PackedMatmul
    down: PackedMatmul


@dataclass(slots=True, frozen=True)
class LayerWeights:
    """One decoder layer's tensors, in the model dtype (the matrices may be quantized)."""

    qkv: Matrix
    qkv_bias: torch.Tensor | None
    o: Matrix
    o_bias: torch.Tensor | None
    gate_up: Matrix
    down: Matrix
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    packed: PackedLayer | None = None  # where the model prepacked its matmuls

    @property
    def matmuls(self) -> tuple[Matrix, ...]:
        return (self.qkv, self.o, self.gate_up, self.down)


@dataclass(slots=True, frozen=True)
class DecoderWeights:
    """Every tensor of a decoder and the shapes that go with them."""

    layers: tuple[LayerWeights, ...]
    embed: Matrix
    final_norm: torch.Tensor
    lm_head: Matrix
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    lm_head_packed: PackedMatmul | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The model dtype (norms, biases, KV cache; the matrices unless quantized)."""
        return self.final_norm.dtype

    @property
    def quantization(self) -> str | None:
        """The matrices' format: None (the model dtype), "int8" or "int4"."""
        return self.lm_head.kind if isinstance(self.lm_head, QuantizedWeight) else None

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def norms(self) -> list[torch.Tensor]:
        """Every RMSNorm weight in the order a forward pass applies them: layer 0's input
        norm, … , the last layer's input norm, then the final norm (post-attention norms
        are per layer: ``LayerWeights.post_attention_norm``)."""
        return [layer.input_norm for layer in self.layers] + [self.final_norm]
