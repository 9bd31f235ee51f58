"""Model implementations, chosen by the checkpoint's architecture name.

Every model follows the ``CausalLM`` protocol: HF-named parameters, and a forward over a
flat batch of tokens from many sequences with a paged KV cache.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..attention import AttentionBatch
from ..decode_kernel import DecodeKernel
from ..errors import UnsupportedModelError
from ..model_config import ModelConfig
from .llama import LlamaForCausalLM


class CausalLM(Protocol):
    config: ModelConfig

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                batch: AttentionBatch) -> torch.Tensor: ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 batch: AttentionBatch) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def named_parameters(self) -> object: ...

    def init_weights(self, seed: int = 0, std: float = 0.02) -> None: ...

    def prepack_cpu_matmuls(self) -> None: ...

    def set_decode_kernel(self, kernel: DecodeKernel | None, fused: bool = True) -> None: ...


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
