"""Weight quantization of a ``LlamaForCausalLM`` (formats and kernels: ``quant.py``), and
the bytes its weights take.

A quantized model holds each matrix, the embedding and the LM head once, as a
``QuantizedWeight`` beside the module that owned it (``qkv_quant``, ``o_quant``,
``gate_up_quant``, ``down_quant``, ``embed_tokens.quant``, the model's untied
``_lm_head_quant``), and their floating-point parameters are left empty, so no second copy
exists. The matmul slots (``qkv_packed`` … ``lm_head_packed``), which hold oneDNN-packed
copies in a floating-point model, hold the quantized matmuls: ``QuantizedMatmul`` (C) where
the decode kernel is set, ``QuantizedLinear`` (torch ops) elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from modelfiles.model_config import ModelConfig

from ..decode_kernel import DecodeKernel
from ..quant import QuantizedLinear, QuantizedWeight, quantize, storage_bytes
from ..weights import PackedMatmul

if TYPE_CHECKING:
    from .llama import LlamaForCausalLM


def embedding_format(kind: str, config: ModelConfig) -> str:
    """The embedding's format under ``kind``: int8 for an int4 model whose head is not the
    embedding (a gather gains no speed from int4, and on the bench model it took int4's
    top-1 agreement from 0.233 to 0.312 and KL from 0.0236 to 0.0204, for 0.07x of the bf16
    bytes: 0.266x to 0.335x), else ``kind`` (a tied embedding is the head, stored once)."""
    return "int8" if kind == "int4" and not config.tie_word_embeddings else kind


# Where a matrix comes from: (its name in a quantized artifact, the float tensor, format)
MatrixSource = Callable[[str, torch.Tensor, str], QuantizedWeight]


def _quantize(name: str, weight: torch.Tensor, kind: str) -> QuantizedWeight:
    return quantize(weight, kind)


@torch.no_grad()
def quantize_model(model: LlamaForCausalLM, kind: str,
                   source: MatrixSource = _quantize) -> None:
    """Quantize every matrix, the embedding and the LM head in place; free the originals.
    ``source`` makes each quantized matrix (default: quantize the model's own; an
    artifact's loader hands in the stored ones, ``quant_artifact.py``), named as
    ``matrix_names`` lists them."""
    if model.quantization is not None:
        raise ValueError(f"the model is quantized already ({model.quantization})")
    names = iter(matrix_names(model))
    for layer in model.model.decoder_layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_quant = source(next(names), attn.qkv_weight, kind)
        attn.o_quant = _quantize_param(attn.o_proj, kind, next(names), source)
        mlp.gate_up_quant = source(next(names), mlp.gate_up_weight, kind)
        mlp.down_quant = _quantize_param(mlp.down_proj, kind, next(names), source)
        for module, prefix in ((attn, "qkv"), (mlp, "gate_up")):
            buffer = getattr(module, f"{prefix}_weight")
            setattr(module, f"{prefix}_weight", buffer.new_empty(0))
            module._bind()  # the HF-named parts become empty views
    if not model.config.tie_word_embeddings:
        model._lm_head_quant = _quantize_param(model.lm_head, kind, next(names), source)
    model.model.embed_tokens.quant = _quantize_param(
        model.model.embed_tokens, embedding_format(kind, model.config), next(names), source)
    model.quantization = kind
    if model.dtype != torch.float32 and model.model.norm.weight.device.type == "cpu":
        norms = [model.model.norm]  # CPU activations are float32 (LlamaForCausalLM.forward)
        for layer in model.model.decoder_layers:
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
        for norm in norms:
            norm.weight32 = norm.weight.float()
    bind_quantized_matmuls(model)


def bind_quantized_matmuls(model: LlamaForCausalLM) -> None:
    """Fill the matmul slots with the quantized matmuls: C where the decode kernel is set
    and can (``DecodeKernel.quantized_matmul``), torch ops otherwise."""
    kernel = model.decode_kernel

    def matmul(weight: QuantizedWeight | None, bias: torch.Tensor | None) -> PackedMatmul:
        if weight is None:
            raise RuntimeError("a quantized model without one of its quantized matrices")
        fast = kernel.quantized_matmul(weight, bias) if isinstance(kernel, DecodeKernel) \
            else None
        return fast or QuantizedLinear(weight, bias)

    for layer in model.model.decoder_layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_packed = matmul(attn.qkv_quant, attn.qkv_bias)
        attn.o_packed = matmul(attn.o_quant, attn.o_proj.bias)
        mlp.gate_up_packed = matmul(mlp.gate_up_quant, None)
        mlp.down_packed = matmul(mlp.down_quant, None)
    head = model.lm_head_matrix
    model.lm_head_packed = matmul(head if isinstance(head, QuantizedWeight) else None, None)


def weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of every tensor the model holds for its weights: parameters, quantized
    matrices and their scales, oneDNN-packed copies, float32 copies of norms (each storage
    once; the rotary tables are not weights)."""
    tensors: list[torch.Tensor] = list(model.parameters())
    tensors += [b for name, b in model.named_buffers() if "rotary_emb" not in name]
    slots: list[object] = [model.lm_head_packed, model.lm_head_matrix,
                           model.model.embed_tokens.quant, model.model.norm.weight32]
    for layer in model.model.decoder_layers:
        attn, mlp = layer.self_attn, layer.mlp
        slots += [attn.qkv_packed, attn.o_packed, mlp.gate_up_packed, mlp.down_packed,
                  attn.qkv_quant, attn.o_quant, mlp.gate_up_quant, mlp.down_quant,
                  layer.input_layernorm.weight32, layer.post_attention_layernorm.weight32]
    for slot in slots:
        tensors += _slot_tensors(slot)
    return storage_bytes(tensors)


def matrix_names(model: LlamaForCausalLM) -> list[str]:
    """The quantized matrices' names, in ``quantize_model``'s order: per layer the fused
    q/k/v, o, fused gate/up and down; the untied LM head; the embedding."""
    names = []
    for i in range(len(model.model.decoder_layers)):
        p = f"model.layers.{i}."
        names += [p + "self_attn.qkv", p + "self_attn.o_proj", p + "mlp.gate_up",
                  p + "mlp.down_proj"]
    if not model.config.tie_word_embeddings:
        names.append("lm_head")
    return [*names, "model.embed_tokens"]


def _quantize_param(module: nn.Module, kind: str, name: str,
                    source: MatrixSource) -> QuantizedWeight:
    """``module.weight`` quantized; the parameter is left empty (its dtype kept)."""
    weight = module.weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.weight is not a tensor")
    quant = source(name, weight, kind)
    module.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)
    return quant


def _slot_tensors(slot: object) -> list[torch.Tensor]:
    """The tensors behind a matmul slot (packed, quantized), a quantized matrix or a tensor."""
    if slot is None:
        return []
    if isinstance(slot, torch.Tensor):
        return [slot]
    if isinstance(slot, QuantizedWeight):
        return list(slot.tensors)
    out: list[torch.Tensor] = []
    for name in ("weight", "bias"):
        out += _slot_tensors(getattr(slot, name, None))
    return out
