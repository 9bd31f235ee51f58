"""Model implementations, chosen by the checkpoint's architecture name.

Every model follows the ``CausalLM`` protocol: HF-named parameters, and a forward over a
flat batch of tokens from many sequences with a paged KV cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from modelfiles.errors import UnsupportedModelError
from modelfiles.model_config import ModelConfig

from ..attention import AttentionBatch, PagedDecodeKernel
from ..fused_decode import FusedDecoder
from ..weights import DecoderWeights
from .llama import LlamaForCausalLM


class CausalLM(Protocol):
    config: ModelConfig
    fused: FusedDecoder | None  # the fused decode step, where set_decode_kernel made one

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                batch: AttentionBatch) -> torch.Tensor: ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 batch: AttentionBatch) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...

    def init_weights(self, seed: int = 0, std: float = 0.02) -> None: ...

    def prepack_cpu_matmuls(self) -> None: ...

    def quantize(self, kind: str) -> None: ...

    def weight_bytes(self) -> int: ...

    def set_decode_kernel(self, kernel: PagedDecodeKernel | None,
                          fused: bool = True) -> None: ...

    def decoder_weights(self) -> DecoderWeights: ...


# Llama, Mistral and Qwen2 share one implementation; ModelConfig encodes the differences
# (q/k/v bias, sliding window cap, rope scaling).
_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """An uninitialised model in eval mode (fill it with the loader or ``init_weights``)."""
    cls = _REGISTRY.get(config.architecture)
    if cls is None:
        raise UnsupportedModelError(
            f"unsupported architecture {config.architecture}; supported: {', '.join(_REGISTRY)}"
        )
    return cls(config, dtype, torch.device(device)).eval()


__all__ = ["CausalLM", "LlamaForCausalLM", "build_model"]
