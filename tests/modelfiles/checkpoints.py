"""Small checkpoints in Hugging Face layout for the tests: one safetensors file, or shards
with their index (what `weight_files` and the engine's loader read)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 40,
    "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "eos_token_id": 2, "bos_token_id": 1, "torch_dtype": "float32",
}

Save = Callable[[Mapping[str, Any], str], None]  # safetensors' numpy or torch save_file


def write_checkpoint(path: Path, config: Mapping[str, Any], state: Mapping[str, Any],
                     save: Save, shards: int = 1) -> None:
    """config.json and the tensors of ``state``: in one file, or ``shards`` + an index."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save(state, str(path / "model.safetensors"))
        return
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: state[n] for n in names[i::shards]}
        save(part, str(path / shard))
        weight_map.update({n: shard for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
