"""A quantized checkpoint: save a quantized model with its exact config, load it back.

``python -m backend.engine.quant_artifact --model DIR --quantization int8 --out OUT``
quantizes a checkpoint once and writes OUT, a checkpoint directory of its own:

    config.json, tokenizer and template files   copied from DIR
    model.safetensors     per quantized matrix ``<name>.qdata`` and ``<name>.qscale``
                          (``llama_quant.matrix_names``), the norms and biases under their
                          HF names, and in the file's metadata the quantization config
    sluice_quantization.json                    the same config, for people to read

The config (``ARTIFACT_KEY`` in the metadata) names everything the bytes depend on: the
format and the embedding's, the group size, the int4 chunk layout, symmetric, float32
scales, the dtype of the rest, each matrix's format and shape, and the source checkpoint's
revision. Loading refuses a config this engine does not produce, and a ``quantization``
that asks for another format. Being in the weight file, the config is part of the
artifact's revision (``modelfiles.revision``), so a pin on it names the exact artifact;
the engine version says ``+int8`` (or ``+int4``) as for quantizing at load.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from modelfiles.errors import ModelLoadError
from modelfiles.model_config import ModelConfig
from modelfiles.revision import INDEX_FILE, SINGLE_FILE, checkpoint_dir, model_revision

from .errors import InvalidRequestError
from .loader import LoadedModel, load_model
from .models import build_model
from .models.llama import LlamaForCausalLM
from .models.llama_quant import embedding_format, matrix_names, quantize_model
from .quant import CHUNK, GROUP, QuantizedWeight

ARTIFACT_KEY = "sluice_quantization"
CONFIG_FILE = "sluice_quantization.json"
VERSION = 1
_FIXED = {"version": VERSION, "group_size": GROUP, "int4_chunk": CHUNK, "symmetric": True,
          "scale_dtype": "float32"}


def read_artifact_config(path: str | Path) -> dict[str, Any] | None:
    """The quantization config of a quantized artifact, None for a plain checkpoint."""
    file = Path(path) / SINGLE_FILE
    if not file.is_file():
        return None
    try:
        with safe_open(str(file), framework="pt") as f:
            text = (f.metadata() or {}).get(ARTIFACT_KEY)
    except Exception as exc:  # safetensors raises its own error types
        raise ModelLoadError(f"cannot open {file}: {exc}") from exc
    if text is None:
        return None
    config = json.loads(text)
    if not isinstance(config, dict):
        raise ModelLoadError(f"{file}: the {ARTIFACT_KEY} metadata is not an object")
    return config


def save_quantized(model: LlamaForCausalLM, source: str | Path, out: str | Path) -> Path:
    """Write ``model`` (quantized) as a checkpoint directory, with the non-weight files of
    ``source`` (the checkpoint it was quantized from)."""
    kind = model.quantization
    if kind is None:
        raise ValueError("save_quantized takes a quantized model (LlamaForCausalLM.quantize)")
    src, dst = checkpoint_dir(source), Path(out)
    dst.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    matrices: dict[str, list[Any]] = {}
    for name, q in zip(matrix_names(model), _matrices(model), strict=True):
        tensors[f"{name}.qdata"] = q.data.detach().cpu().contiguous()
        tensors[f"{name}.qscale"] = q.scale.detach().cpu().contiguous()
        matrices[name] = [q.kind, *q.shape]
    for name, p in model.named_parameters():
        if p.numel():  # norms and biases (the matrices' parameters are empty)
            tensors[name] = p.detach().cpu().clone().contiguous()
    config = {**_FIXED, "quantization": kind,
              "embedding": embedding_format(kind, model.config),
              "dtype": str(model.dtype).removeprefix("torch."),
              "source_revision": model_revision(src), "matrices": matrices}
    text = json.dumps(config, sort_keys=True)
    save_file(tensors, str(dst / SINGLE_FILE), metadata={"format": "pt", ARTIFACT_KEY: text})
    for file in src.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors") \
                and file.name not in (INDEX_FILE, CONFIG_FILE):
            shutil.copyfile(file, dst / file.name)
    (dst / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return dst


def load_quantized(path: str | Path, dtype: torch.dtype, device: torch.device,
                   expected: str | None = None) -> LoadedModel:
    """Load a quantized artifact; ``expected`` (the engine's ``quantization``), where
    given, must be its format."""
    root = checkpoint_dir(path)
    config = read_artifact_config(root)
    if config is None:
        raise ModelLoadError(f"{root} is not a quantized artifact (no {ARTIFACT_KEY})")
    wrong = {k: config.get(k) for k, v in _FIXED.items() if config.get(k) != v}
    kind = config.get("quantization")
    if wrong or kind not in ("int8", "int4"):
        raise ModelLoadError(f"{root}: a quantization config this engine does not make "
                             f"({wrong or {'quantization': kind}}; it makes {_FIXED})")
    if expected is not None and expected != kind:
        raise InvalidRequestError(f"{root} holds {kind}-quantized weights; quantization "
                                  f"{expected} asks for another format", "quantization")
    mcfg = ModelConfig.from_dir(root)
    model = build_model(mcfg, dtype, device)
    params = dict(model.named_parameters())
    stored: dict[str, QuantizedWeight] = {}
    try:
        with torch.no_grad(), safe_open(str(root / SINGLE_FILE), framework="pt") as f:
            for name, (fmt, n, k) in config["matrices"].items():
                stored[name] = QuantizedWeight(fmt, f.get_tensor(f"{name}.qdata").to(device),
                                               f.get_tensor(f"{name}.qscale").to(device),
                                               (n, k))
            for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                if not name.endswith((".qdata", ".qscale")):
                    params[name].copy_(f.get_tensor(name))
    except ModelLoadError:
        raise
    except Exception as exc:  # safetensors' own errors, a missing or misshapen tensor
        raise ModelLoadError(f"{root}: cannot read the quantized weights: {exc}") from exc

    def source(name: str, weight: torch.Tensor, fmt: str) -> QuantizedWeight:
        q = stored.get(name)
        if q is None or q.kind != fmt or q.shape != tuple(weight.shape):
            raise ModelLoadError(f"{root}: matrix {name} is missing or is not {fmt} "
                                 f"{tuple(weight.shape)}")
        return q

    if not isinstance(model, LlamaForCausalLM):
        raise ModelLoadError(f"{root}: quantized artifacts hold Llama-family models")
    quantize_model(model, kind, source)
    return LoadedModel(model=model, config=mcfg, path=root)


def load_weights(path: str | Path, dtype: torch.dtype, device: torch.device,
                 quantization: str | None) -> tuple[LoadedModel, str | None]:
    """The engine's model: a quantized artifact as stored (``quantization``, if given, must
    be its format), or a checkpoint quantized at load to ``quantization`` (or not); and
    the format it runs in."""
    config = read_artifact_config(path)
    if config is not None:
        return load_quantized(path, dtype, device, quantization), str(config["quantization"])
    loaded = load_model(path, dtype, device)
    if quantization is not None:  # frees the floating-point matrices; no packed copy
        loaded.model.quantize(quantization)
    return loaded, quantization


def _matrices(model: LlamaForCausalLM) -> list[QuantizedWeight]:
    """The model's quantized matrices in ``matrix_names`` order."""
    out: list[QuantizedWeight | None] = []
    for layer in model.model.decoder_layers:
        out += [layer.self_attn.qkv_quant, layer.self_attn.o_quant, layer.mlp.gate_up_quant,
                layer.mlp.down_quant]
    if not model.config.tie_word_embeddings:
        out.append(model._lm_head_quant)
    out.append(model.model.embed_tokens.quant)
    if any(q is None for q in out):
        raise ValueError("a quantized model without one of its quantized matrices")
    return [q for q in out if q is not None]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.engine.quant_artifact",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory to quantize")
    ap.add_argument("--quantization", required=True, choices=("int8", "int4"))
    ap.add_argument("--out", required=True, type=Path, help="directory to write")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                    help="dtype of the norms and biases (default bfloat16)")
    args = ap.parse_args(argv)
    loaded = load_model(args.model, getattr(torch, args.dtype), torch.device("cpu"))
    model = loaded.model
    if not isinstance(model, LlamaForCausalLM):
        print("error: only Llama-family models are quantized", file=sys.stderr)
        return 2
    model.quantize(args.quantization)
    out = save_quantized(model, args.model, args.out)
    print(f"wrote {out} ({args.quantization}, revision {model_revision(out)[:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
