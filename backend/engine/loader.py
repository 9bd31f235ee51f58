"""Load an HF-layout checkpoint directory (config.json + safetensors) into a model.

Which files hold the weights is ``modelfiles.revision.weight_files``'s answer (one file, or
the shards an index names). Tensors are read one at a time with ``safe_open`` and copied
straight into the (pre-allocated, target dtype/device) parameters, so peak extra memory is
one tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from modelfiles.errors import ModelLoadError
from modelfiles.model_config import ModelConfig
from modelfiles.revision import checkpoint_dir, weight_files

from .models import CausalLM, build_model


@dataclass(slots=True, frozen=True)
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    path: Path


def _ignored(name: str) -> bool:
    return name.endswith("rotary_emb.inv_freq")


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device | str) -> LoadedModel:
    """Build the model for ``path``'s config and fill every parameter from its weights."""
    root = checkpoint_dir(path)
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
