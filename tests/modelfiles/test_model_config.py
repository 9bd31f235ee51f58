"""ModelConfig: both HF config layouts, and the limits it enforces."""

from __future__ import annotations

import pytest

from modelfiles.errors import UnsupportedModelError
from modelfiles.model_config import ModelConfig


def test_rope_parameters_and_legacy_rope_scaling_agree() -> None:
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
            "max_position_embeddings": 1024}
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    new = ModelConfig.from_hf({**base, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, **scaling}})
    old = ModelConfig.from_hf({**base, "rope_theta": 5e5,
                               "rope_scaling": {"type": "llama3", **scaling}})
    assert new == old and new.rope_scaling is not None and new.rope_theta == 5e5
    assert new.head_dim == 4 and new.num_key_value_heads == 2 and new.eos_token_ids == ()
    plain = ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "default"},
                                 "eos_token_id": [1, 2]})
    assert plain.rope_scaling is None and plain.eos_token_ids == (1, 2)
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


def test_sliding_window_caps_max_positions() -> None:
    d = {"architectures": ["MistralForCausalLM"], "vocab_size": 10, "hidden_size": 8,
         "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
         "max_position_embeddings": 32768, "sliding_window": 4096}
    assert ModelConfig.from_hf(d).max_position_embeddings == 4096
    qwen = {**d, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False}
    cfg = ModelConfig.from_hf(qwen)
    assert cfg.max_position_embeddings == 32768 and cfg.attention_bias and not cfg.o_proj_bias
