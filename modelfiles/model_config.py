"""The model's shape and numerics, parsed once from a Hugging Face ``config.json``.

Both config layouts are accepted:

- transformers < 5: top-level ``rope_theta`` plus an optional ``rope_scaling`` dict
  (``{"rope_type" | "type": "llama3", "factor": …}``);
- transformers >= 5: a ``rope_parameters`` dict that carries ``rope_theta`` and
  ``rope_type`` together (``{"rope_type": "default", "rope_theta": 10000.0}``).

Sliding-window attention (Mistral v0.1, Qwen2 with ``use_sliding_window``) is not
implemented as a mask. Instead ``max_position_embeddings`` is capped to the window: a
sequence no longer than the window attends exactly as full attention would, so every
sequence the engine admits is computed exactly. ``sliding_window`` keeps the raw value.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import MissingFileError, ModelLoadError, UnsupportedModelError
from .jsonfile import read_json_object

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
)
# Configs written from a bare config object (no model) lack "architectures".
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(slots=True, frozen=True)
class RopeScaling:
    """A RoPE frequency rescaling; ``None`` on the config means plain RoPE."""

    rope_type: str  # "linear" | "llama3"
    factor: float
    # llama3 only (0 / 0 / 0 for linear):
    low_freq_factor: float = 0.0
    high_freq_factor: float = 0.0
    original_max_position_embeddings: int = 0


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int  # capped to sliding_window when that is smaller
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    o_proj_bias: bool  # Llama's attention_bias also covers o_proj; Qwen2's does not
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str | None
    sliding_window: int | None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Parse ``<path>/config.json``."""
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise MissingFileError(f"config.json not found in {path} (looked for {config_path})")
        return cls.from_hf(read_json_object(config_path))

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Parse an HF config dict; raise UnsupportedModelError for what we cannot run."""
        arch = _architecture(d)
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            kv_heads = int(d.get("num_key_value_heads") or heads)
            head_dim = int(d.get("head_dim") or hidden // heads)
            max_pos = int(d.get("max_position_embeddings", 2048))
            vocab = int(d["vocab_size"])
            inter = int(d["intermediate_size"])
            layers = int(d["num_hidden_layers"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json lacks a valid field: {exc}") from exc
        if heads % kv_heads:
            raise ModelLoadError(
                f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {act!r}; supported: 'silu'")
        rope_theta, rope_scaling = _rope(d, max_pos)

        if arch == "Qwen2ForCausalLM":
            attention_bias, o_proj_bias = True, False
            window = d.get("sliding_window") if d.get("use_sliding_window") else None
        elif arch == "MistralForCausalLM":
            attention_bias = o_proj_bias = False
            window = d.get("sliding_window")
        else:
            attention_bias = o_proj_bias = bool(d.get("attention_bias", False))
            window = None
        if d.get("mlp_bias"):
            raise UnsupportedModelError("unsupported mlp_bias=true")
        window = int(window) if window else None
        if window is not None and window < max_pos:
            max_pos = window  # see module docstring: exact for every sequence <= window

        eos = d.get("eos_token_id")
        eos_ids: tuple[int, ...]
        if eos is None:
            eos_ids = ()
        elif isinstance(eos, list):
            eos_ids = tuple(int(e) for e in eos)
        else:
            eos_ids = (int(eos),)
        bos = d.get("bos_token_id")
        dtype = d.get("torch_dtype", d.get("dtype"))
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=False,
            eos_token_ids=eos_ids,
            bos_token_id=int(bos) if bos is not None else None,
            torch_dtype=str(dtype) if dtype is not None else None,
            sliding_window=window,
        )


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    if not archs and d.get("model_type") in _ARCH_BY_MODEL_TYPE:
        archs = [_ARCH_BY_MODEL_TYPE[d["model_type"]]]
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return str(arch)
    named = ", ".join(map(str, archs)) or f"model_type={d.get('model_type')!r}"
    raise UnsupportedModelError(
        f"unsupported architecture {named}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope(d: dict[str, Any], max_pos: int) -> tuple[float, RopeScaling | None]:
    """Merge the old (rope_theta + rope_scaling) and new (rope_parameters) layouts."""
    params: dict[str, Any] = dict(d.get("rope_parameters") or {})
    params.update(d.get("rope_scaling") or {})  # old layout; wins like in transformers
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise UnsupportedModelError(f"unsupported partial_rotary_factor {partial}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope scaling type {rope_type!r}; supported: "
            + ", ".join(_SUPPORTED_ROPE_TYPES)
        )
    if rope_type == "default":
        return theta, None
    try:
        factor = float(params["factor"])
        if rope_type == "linear":
            return theta, RopeScaling("linear", factor)
        original = params.get(
            "original_max_position_embeddings",
            d.get("original_max_position_embeddings", max_pos),
        )
        return theta, RopeScaling(
            "llama3",
            factor,
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(original),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"rope scaling {rope_type!r} lacks a valid field: {exc}") from exc
