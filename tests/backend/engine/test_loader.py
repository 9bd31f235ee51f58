"""Loader errors and checkpoint layouts (no transformers needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from backend.engine.loader import load_model
from backend.engine.models import build_model
from modelfiles.errors import MissingFileError, ModelLoadError, UnsupportedModelError
from modelfiles.model_config import ModelConfig
from tests.modelfiles.checkpoints import CONFIG, write_checkpoint


def _write(path: Path, config: dict[str, Any] = CONFIG, shards: int = 1) -> dict[str, Any]:
    model: Any = build_model(ModelConfig.from_hf(config), torch.float32, torch.device("cpu"))
    model.init_weights(seed=3)
    state = model.export_state_dict()
    write_checkpoint(path, config, state, save_file, shards)
    return state


def test_loads_single_and_sharded_identically(tmp_path: Path) -> None:
    state = _write(tmp_path / "one")
    _write(tmp_path / "many", shards=3)
    one = load_model(tmp_path / "one", torch.float32, torch.device("cpu"))
    many = load_model(tmp_path / "many", torch.float32, torch.device("cpu"))
    for name, tensor in dict(one.model.named_parameters()).items():
        assert torch.equal(tensor, state[name]), name
        assert torch.equal(tensor, dict(many.model.named_parameters())[name])
    assert one.config.eos_token_ids == (2,) and one.path == tmp_path / "one"


def test_loads_to_target_dtype_and_ignores_inv_freq(tmp_path: Path) -> None:
    state = _write(tmp_path)
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(2)
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = load_model(tmp_path, torch.bfloat16, "cpu")
    w = loaded.model.model.layers[1].mlp.up_proj.weight
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, state["model.layers.1.mlp.up_proj.weight"].bfloat16())


def test_tied_checkpoint_without_lm_head(tmp_path: Path) -> None:
    state = _write(tmp_path, {**CONFIG, "tie_word_embeddings": True})
    assert "lm_head.weight" not in state
    loaded = load_model(tmp_path, torch.float32, "cpu")
    hidden = torch.randn(2, 16)
    expected = hidden @ state["model.embed_tokens.weight"].T
    assert torch.allclose(loaded.model.compute_logits(hidden), expected, atol=1e-5)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(MissingFileError, match="nope"):
        load_model(tmp_path / "nope", torch.float32, "cpu")


def test_missing_config(tmp_path: Path) -> None:
    _write(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(MissingFileError, match="config.json"):
        load_model(tmp_path, torch.float32, "cpu")


def test_missing_weights_file(tmp_path: Path) -> None:
    _write(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(MissingFileError, match=r"model\.safetensors.*index\.json"):
        load_model(tmp_path, torch.float32, "cpu")


def test_missing_shard(tmp_path: Path) -> None:
    _write(tmp_path, shards=3)
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(MissingFileError, match="model-00002-of-00003.safetensors"):
        load_model(tmp_path, torch.float32, "cpu")


def test_unknown_architecture(tmp_path: Path) -> None:
    _write(tmp_path)
    config = {**CONFIG, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(tmp_path, torch.float32, "cpu")


def test_missing_tensor(tmp_path: Path) -> None:
    state = _write(tmp_path)
    del state["model.layers.1.self_attn.v_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.v_proj\.weight"):
        load_model(tmp_path, torch.float32, "cpu")


def test_wrong_shape_and_unexpected_tensor(tmp_path: Path) -> None:
    state = _write(tmp_path)
    state["model.norm.weight"] = torch.ones(17)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.norm\.weight.*\(17,\)"):
        load_model(tmp_path, torch.float32, "cpu")
    state["model.norm.weight"] = torch.ones(16)
    state["model.extra.weight"] = torch.ones(3)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.extra\.weight"):
        load_model(tmp_path, torch.float32, "cpu")
