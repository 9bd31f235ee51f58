"""A wider, deeper variant of the tiny checkpoint, for the capacity experiment on CPU.

The tiny model (hidden 64, 4 layers) costs so little per step that, on a CPU, Python
overhead and HTTP relaying dominate: a load test would then measure the web layers, not
admission in front of a saturated model. This variant keeps the tiny model's tokenizer
and chat template and scales the Llama shapes up (seeded random weights, written locally,
nothing downloaded), so a decode step costs milliseconds and a long prompt's prefill costs
a noticeable fraction of a second: batching pays and capacity is set by the model, as on
a GPU server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 384, 1024, 6, 6, 2
SEED = 7


def _weights(vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.Generator(np.random.PCG64(SEED))

    def linear(out_f: int, in_f: int, gain: float = 1.0) -> np.ndarray:
        w = rng.standard_normal((out_f, in_f), dtype=np.float32)
        return (w * np.float32(gain / np.sqrt(in_f))).astype(np.float32)

    head = HIDDEN // HEADS
    t = {"model.embed_tokens.weight": rng.standard_normal((vocab, HIDDEN), dtype=np.float32)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = np.ones(HIDDEN, dtype=np.float32)
        t[p + "self_attn.q_proj.weight"] = linear(HEADS * head, HIDDEN)
        t[p + "self_attn.k_proj.weight"] = linear(KV_HEADS * head, HIDDEN)
        t[p + "self_attn.v_proj.weight"] = linear(KV_HEADS * head, HIDDEN)
        t[p + "self_attn.o_proj.weight"] = linear(HIDDEN, HEADS * head)
        t[p + "post_attention_layernorm.weight"] = np.ones(HIDDEN, dtype=np.float32)
        t[p + "mlp.gate_proj.weight"] = linear(INTERMEDIATE, HIDDEN)
        t[p + "mlp.up_proj.weight"] = linear(INTERMEDIATE, HIDDEN)
        t[p + "mlp.down_proj.weight"] = linear(HIDDEN, INTERMEDIATE)
    t["model.norm.weight"] = np.ones(HIDDEN, dtype=np.float32)
    t["lm_head.weight"] = linear(vocab, HIDDEN, gain=4.0)
    return t


def write_small_model(out: Path) -> Path:
    """The tiny model's tokenizer files plus scaled-up config and weights, in ``out``.

    The tiny checkpoint comes from `sluice tiny-model` (loadtest talks to the rest of Sluice
    through its command line and HTTP only)."""
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-m", "sluice.cli", "tiny-model", "--out", str(out)],
                   check=True, cwd=root, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(root)})
    config = json.loads((out / "config.json").read_text())
    config.update(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                  num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(_weights(int(config["vocab_size"])), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out
