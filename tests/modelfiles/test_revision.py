"""The weight files of a checkpoint and the revision hash over them (numpy only, no torch)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from modelfiles.errors import MissingFileError
from modelfiles.revision import model_revision, weight_files
from tests.modelfiles.checkpoints import CONFIG, write_checkpoint


def _write(path: Path, config: dict[str, Any] = CONFIG, shards: int = 1) -> dict[str, Any]:
    """A checkpoint of seeded float32 tensors, in one file or ``shards`` files + an index."""
    rng = np.random.Generator(np.random.PCG64(3))
    state = {f"model.layers.{i}.mlp.up_proj.weight": rng.standard_normal((32, 16),
                                                                          dtype=np.float32)
             for i in range(config["num_hidden_layers"])}
    state["model.norm.weight"] = np.ones(16, dtype=np.float32)
    write_checkpoint(path, config, state, save_file, shards)
    return state


def test_model_revision_is_stable_and_content_addressed(tmp_path: Path) -> None:
    _write(tmp_path / "a", shards=2)
    rev = model_revision(tmp_path / "a")
    assert rev == model_revision(tmp_path / "a") and len(rev) == 64
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert model_revision(tmp_path / "b") == rev  # depends on content, not location
    shard = tmp_path / "b" / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # one bit of one weight
    shard.write_bytes(bytes(data))
    assert load_file(str(shard))  # still a valid file
    assert model_revision(tmp_path / "b") != rev
    (tmp_path / "a" / "config.json").write_text(json.dumps({**CONFIG, "rms_norm_eps": 1e-5}))
    assert model_revision(tmp_path / "a") != rev


def test_weight_files_single_and_sharded(tmp_path: Path) -> None:
    _write(tmp_path / "one")
    assert weight_files(tmp_path / "one") == [tmp_path / "one" / "model.safetensors"]
    _write(tmp_path / "many", shards=3)
    assert [p.name for p in weight_files(tmp_path / "many")] == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(MissingFileError, match="nope"):
        model_revision(tmp_path / "nope")
    _write(tmp_path / "a")
    (tmp_path / "a" / "config.json").unlink()
    with pytest.raises(MissingFileError, match=r"config\.json"):
        model_revision(tmp_path / "a")
    _write(tmp_path / "b", shards=2)
    (tmp_path / "b" / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(MissingFileError, match=r"model-00001-of-00002\.safetensors"):
        weight_files(tmp_path / "b")
