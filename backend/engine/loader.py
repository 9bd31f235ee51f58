"""Load an HF-layout checkpoint directory (config.json + safetensors) into a model.

Accepted layouts: ``model.safetensors``, or ``model.safetensors.index.json`` naming
shards. Tensors are read one at a time with ``safe_open`` and copied straight into the
(pre-allocated, target dtype/device) parameters, so peak extra memory is one tensor.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import MissingFileError, ModelLoadError
from .model_config import ModelConfig
from .models import CausalLM, build_model

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_CHUNK = 1 << 20


@dataclass(slots=True, frozen=True)
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    path: Path


def _checkpoint_dir(path: str | Path) -> Path:
    root = Path(path)
    if not root.is_dir():
        raise MissingFileError(f"model directory not found: {root}")
    return root


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files holding the weights (every shard the index names)."""
    root = _checkpoint_dir(path)
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"cannot read {index}: {exc}") from exc
        shards = [root / name for name in sorted(set(weight_map.values()))]
        for shard in shards:
            if not shard.is_file():
                raise MissingFileError(f"shard {shard.name} named in {INDEX_FILE} is missing")
        return shards
    single = root / SINGLE_FILE
    if single.is_file():
        return [single]
    raise MissingFileError(f"no weights in {root}: looked for {SINGLE_FILE} and {INDEX_FILE}")


def _ignored(name: str) -> bool:
    return name.endswith("rotary_emb.inv_freq")


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device | str) -> LoadedModel:
    """Build the model for ``path``'s config and fill every parameter from its weights."""
    root = _checkpoint_dir(path)
    config = ModelConfig.from_dir(root)
    files = weight_files(root)
    device = torch.device(device)
    model = build_model(config, dtype, device)
    params = dict(model.named_parameters())
    missing = set(params)
    # safetensors can place tensors on an accelerator directly; CPU reads are mmap-backed.
    read_device = "cpu" if device.type == "cpu" else str(device)
    with torch.no_grad():
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt", device=read_device)
            except Exception as exc:  # safetensors raises its own error types
                raise ModelLoadError(f"cannot open {file.name}: {exc}") from exc
            with handle as f:
                for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    if _ignored(name):
                        continue
                    param = params.get(name)
                    if param is None:
                        if name == "lm_head.weight" and config.tie_word_embeddings:
                            continue  # tied: the embedding already is the head
                        raise ModelLoadError(f"unexpected tensor {name} in {file.name}")
                    tensor = f.get_tensor(name)
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise ModelLoadError(
                            f"tensor {name} has shape {tuple(tensor.shape)}, "
                            f"expected {tuple(param.shape)}")
                    param.copy_(tensor)  # casts to the target dtype in the same pass
                    missing.discard(name)
    if missing:
        raise ModelLoadError(f"checkpoint lacks tensor(s): {', '.join(sorted(missing))}")
    return LoadedModel(model=model, config=config, path=root)


def model_revision(path: str | Path) -> str:
    """sha256 over config.json and the weight files, each prefixed by its name."""
    root = _checkpoint_dir(path)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise MissingFileError(f"config.json not found in {root}")
    digest = hashlib.sha256()
    for file in [config_path, *sorted(weight_files(root), key=lambda p: p.name)]:
        digest.update(file.name.encode() + b"\0")
        digest.update(str(file.stat().st_size).encode() + b"\0")
        with file.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()
