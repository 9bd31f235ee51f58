"""Helpers shared by the model and loader tests (imported explicitly, not a conftest)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from backend.engine.attention import build_attention_batch
from backend.engine.kv_cache import allocate_kv_cache
from backend.engine.models import CausalLM
from modelfiles.model_config import ModelConfig

TINY: dict[str, Any] = {
    "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "initializer_range": 0.1,
}


def save_hf_checkpoint(kind: str, out: Path, seed: int = 0,
                       max_shard_size: str | None = None) -> torch.nn.Module:
    """A seeded random HF model of ``kind`` saved as safetensors; returns it (fp32, eager)."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "llama3":
        cfg: Any = tf.LlamaConfig(**TINY, tie_word_embeddings=False, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        model: Any = tf.LlamaForCausalLM(cfg)
    elif kind == "llama_tied":
        cfg = tf.LlamaConfig(**{**TINY, "num_key_value_heads": 4}, tie_word_embeddings=True,
                             rope_theta=500.0)
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "mistral":
        cfg = tf.MistralConfig(**{**TINY, "num_key_value_heads": 1}, sliding_window=4096)
        model = tf.MistralForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**TINY, tie_word_embeddings=False)
        model = tf.Qwen2ForCausalLM(cfg)
    else:
        raise ValueError(kind)
    cfg._attn_implementation = "eager"
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # make norms and biases non-trivial
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    model.eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    return model


def hf_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    """Reference logits [len(tokens), vocab] for one full sequence."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


class PagedRunner:
    """Drives a model like the engine would: shuffled block allocation, paged steps."""

    def __init__(self, model: CausalLM, config: ModelConfig, block_size: int = 4,
                 num_blocks: int = 64, dtype: torch.dtype = torch.float32, seed: int = 0):
        self.model, self.block_size = model, block_size
        self.kv = allocate_kv_cache(config, num_blocks, block_size, dtype, torch.device("cpu"))
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # deliberately non-contiguous tables
        self.tables: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}

    def step(self, work: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Run one forward over several sequences; logits for every new token, per sequence."""
        specs = []
        for sid, toks in work:
            table = self.tables.setdefault(sid, [])
            done = self.computed.setdefault(sid, 0)
            while len(table) * self.block_size < done + len(toks):
                table.append(self.free.pop())
            specs.append((list(table), done, len(toks)))
        batch = build_attention_batch(specs, self.block_size, "cpu")
        ids = torch.tensor([t for _, toks in work for t in toks])
        hidden = self.model(ids, batch.positions, self.kv, batch)
        logits = self.model.compute_logits(hidden)
        out, start = [], 0
        for sid, toks in work:
            out.append(logits[start:start + len(toks)])
            start += len(toks)
            self.computed[sid] += len(toks)
        return out
