"""The bench model: a random Llama config written as a Hugging Face checkpoint.

Weights are seeded N(0, 0.02) (norms 1), stored in the bench dtype, untied head. The
tokenizer files come from the bundled tiny model: its vocabulary (~1k) is smaller than
the bench model's, which is fine because prompts are drawn from the tokenizer's ids and
decoding an id past the tokenizer's vocabulary yields no text rather than an error.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from modelfiles.tiny_model import ensure_tiny_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass(slots=True, frozen=True)
class ModelSpec:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_positions: int = 2048

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """HF tensor names and shapes."""
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * d, self.num_kv_heads * d
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            out |= {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        out["model.norm.weight"] = (h,)
        out["lm_head.weight"] = (self.vocab_size, h)
        return out

    @property
    def num_params(self) -> int:
        total = 0
        for shape in self.shapes().values():
            n = 1
            for s in shape:
                n *= s
            total += n
        return total

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (all but embedding and norms)."""
        total = 0
        for name, shape in self.shapes().items():
            if len(shape) == 2 and name != "model.embed_tokens.weight":
                total += shape[0] * shape[1]
        return total

    def hf_config(self, dtype: torch.dtype) -> dict[str, object]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }


# ~56M parameters: the "~50M Llama". GQA (kv heads = heads / 2) as in Llama 3.
FULL_MODEL = ModelSpec(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                       intermediate_size=1408, vocab_size=32000)
# ~7M parameters, for --quick and the tests.
QUICK_MODEL = ModelSpec(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                        intermediate_size=704, vocab_size=8192)
TEST_MODEL = ModelSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       intermediate_size=128, vocab_size=2048, max_positions=512)


def write_checkpoint(out_dir: Path, spec: ModelSpec, dtype: torch.dtype, seed: int = 0) -> Path:
    """Write config.json, model.safetensors and the tiny model's tokenizer files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in spec.shapes().items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        else:
            t = torch.randn(shape, generator=gen) * 0.02
        tensors[name] = t.to(dtype).contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(spec.hf_config(dtype), indent=2))
    tiny = ensure_tiny_model()
    for fname in TOKENIZER_FILES:
        if (tiny / fname).is_file():
            shutil.copyfile(tiny / fname, out_dir / fname)
    return out_dir
