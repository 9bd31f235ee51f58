"""A quantized artifact (quant_artifact.py): saved with its exact config, loaded back into
an engine that computes exactly what quantizing at load computes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from backend.engine.builder import EngineParts, build_engine
from backend.engine.config import EngineConfig
from backend.engine.errors import InvalidRequestError
from backend.engine.quant_artifact import (
    ARTIFACT_KEY,
    CONFIG_FILE,
    main,
    read_artifact_config,
)
from backend.engine.sampling import SamplingParams
from modelfiles.errors import ModelLoadError
from modelfiles.revision import model_revision
from modelfiles.tiny_model import ensure_tiny_model


def _greedy(parts: EngineParts) -> list[list[int]]:
    core = parts.core
    prompts = [[5 + i, 40 + 3 * i, 7, 300 - i] for i in range(4)]
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0.0,
                                                    ignore_eos=True, logprobs=2))
    out: dict[str, list[int]] = {}
    while core.has_work():
        for d in core.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)
    return [out[f"r{i}"] for i in range(4)]


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_an_artifact_serves_what_quantizing_at_load_serves(tmp_path: Path, kind: str) -> None:
    source = ensure_tiny_model()
    out = tmp_path / "q"
    assert main(["--model", str(source), "--quantization", kind, "--out", str(out)]) == 0
    config = read_artifact_config(out)
    assert config is not None and config["quantization"] == kind
    assert config["source_revision"] == model_revision(source)
    assert json.loads((out / CONFIG_FILE).read_text()) == config
    assert read_artifact_config(source) is None
    at_load = build_engine(EngineConfig(model=str(source), dtype="bfloat16", quantization=kind,
                                        kv_blocks=64))
    stored = build_engine(EngineConfig(model=str(out), dtype="bfloat16", kv_blocks=64))
    assert _greedy(stored) == _greedy(at_load)
    assert stored.core.state().weight_bytes == at_load.core.state().weight_bytes
    v = stored.versions.versions
    assert v.engine == at_load.versions.versions.engine and v.engine.endswith(f"+{kind}")
    assert v.revision == model_revision(out) != at_load.versions.versions.revision
    other = "int4" if kind == "int8" else "int8"
    with pytest.raises(InvalidRequestError, match=f"holds {kind}-quantized weights"):
        build_engine(EngineConfig(model=str(out), quantization=other, kv_blocks=64))


def test_an_artifact_of_another_config_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "q"
    main(["--model", str(ensure_tiny_model()), "--quantization", "int8", "--out", str(out)])
    file = out / "model.safetensors"
    tensors = load_file(str(file))
    config = read_artifact_config(out)
    assert config is not None
    save_file(tensors, str(file), metadata={"format": "pt", ARTIFACT_KEY: json.dumps(
        {**config, "group_size": 64})})
    with pytest.raises(ModelLoadError, match="does not make"):
        build_engine(EngineConfig(model=str(out), kv_blocks=64))
    del tensors["model.layers.0.mlp.gate_up.qdata"]
    save_file(tensors, str(file), metadata={"format": "pt", ARTIFACT_KEY: json.dumps(config)})
    with pytest.raises(ModelLoadError, match="gate_up"):
        build_engine(EngineConfig(model=str(out), kv_blocks=64))
