"""The decoder's weights as a plain value (``DecoderWeights``): what the model builds, and
that the C kernels read nothing else."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from backend.engine.decode_kernel import DecodeKernel
from backend.engine.loader import load_model
from backend.engine.models.llama import LlamaForCausalLM
from backend.engine.weights import DecoderWeights, LayerWeights
from tests.backend.engine.conftest import fused_or_skip
from tests.backend.engine.conftest_models import PagedRunner, save_hf_checkpoint

pytest.importorskip("transformers")


def _load(path: Path, kind: str, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    save_hf_checkpoint(kind, path, seed=4)
    model: Any = load_model(path, dtype, torch.device("cpu")).model
    return model  # type: ignore[no-any-return]


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """The same storage at the same place (a reference, not a copy)."""
    if a is None or b is None:
        return a is b
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype


@pytest.mark.parametrize("kind", ["llama3", "llama_tied", "qwen2"])
def test_the_model_builds_references_to_its_own_tensors(tmp_path: Path, kind: str) -> None:
    model = _load(tmp_path, kind)
    cfg = model.config
    w = model.decoder_weights()
    assert (w.num_layers, w.hidden_size, w.intermediate_size, w.num_heads, w.num_kv_heads,
            w.head_dim, w.rms_norm_eps) == (
        cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size,
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps)
    assert w.dtype == torch.float32 and w.device.type == "cpu"
    m = model.model
    for lw, layer in zip(w.layers, m.decoder_layers, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        assert lw.qkv.shape == (w.q_size + 2 * w.kv_size, w.hidden_size)
        assert _same(lw.qkv[:w.q_size], attn.q_proj.weight)  # the HF-named views alias it
        assert _same(lw.o, attn.o_proj.weight) and _same(lw.down, mlp.down_proj.weight)
        assert _same(lw.gate_up[w.intermediate_size:], mlp.up_proj.weight)
        assert _same(lw.input_norm, layer.input_layernorm.weight)
        assert _same(lw.post_attention_norm, layer.post_attention_layernorm.weight)
        assert (lw.qkv_bias is not None) == (kind == "qwen2")
        assert lw.packed is None  # nothing prepacked yet
    assert _same(w.embed, m.embed_tokens.weight) and _same(w.final_norm, m.norm.weight)
    assert _same(w.lm_head, w.embed) == (kind == "llama_tied")
    assert w.norms == [lw.input_norm for lw in w.layers] + [w.final_norm]
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.embed = w.lm_head  # type: ignore[misc]


def test_prepacking_adds_the_packed_matmuls(tmp_path: Path) -> None:
    model = _load(tmp_path, "llama3")
    from backend.engine.models.linear import can_prepack

    if not can_prepack(torch.device("cpu")):
        pytest.skip("this torch build cannot prepack")
    model.prepack_cpu_matmuls()
    w = model.decoder_weights()
    assert all(lw.packed is not None for lw in w.layers) and w.lm_head_packed is not None
    x = torch.randn(3, w.hidden_size)
    packed = w.layers[0].packed
    assert packed is not None
    assert torch.allclose(packed.qkv(x), x @ w.layers[0].qkv.T, atol=1e-4)


def _clone(w: DecoderWeights) -> DecoderWeights:
    """The same values in fresh storage."""
    def copy(t: torch.Tensor | None) -> Any:
        return None if t is None else t.detach().clone()

    layers = tuple(LayerWeights(
        qkv=copy(lw.qkv), qkv_bias=copy(lw.qkv_bias), o=copy(lw.o), o_bias=copy(lw.o_bias),
        gate_up=copy(lw.gate_up), down=copy(lw.down), input_norm=copy(lw.input_norm),
        post_attention_norm=copy(lw.post_attention_norm)) for lw in w.layers)
    return dataclasses.replace(w, layers=layers, embed=copy(w.embed),
                               final_norm=copy(w.final_norm))


def test_the_fused_step_reads_only_its_weights_object(tmp_path: Path,
                                                      kernel: DecodeKernel) -> None:
    """A fused step built over copies of the weights decodes exactly as the model's own,
    and keeps doing so after the model's decoder layers are overwritten: it reads nothing
    but the ``DecoderWeights`` it was given (and the KV cache)."""
    model = _load(tmp_path, "qwen2")
    model.set_decode_kernel(kernel)
    fused_or_skip(model)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    runners = [PagedRunner(model, model.config, seed=2) for _ in range(2)]
    for runner in runners:  # the same prefill (torch path) into two caches
        runner.step([(0, prompts[0]), (1, prompts[1])])
    decode = [(0, [21]), (1, [22])]
    ref = runners[0].step(decode)  # the model's own fused step
    copies = _clone(model.decoder_weights())
    own = kernel.fused_decoder(copies)
    assert own is not None and own.weights is copies
    with torch.no_grad():
        for p in model.model.layers.parameters():  # q/k/v, gate/up alias the fused tensors
            p.fill_(0.25)
    assert not torch.equal(copies.layers[0].qkv, model.decoder_weights().layers[0].qkv)
    model.fused = own
    got = runners[1].step(decode)
    for r, g in zip(ref, got, strict=True):
        assert torch.equal(r, g)


def test_a_moved_model_gets_a_fused_step_over_its_moved_weights(tmp_path: Path,
                                                                kernel: DecodeKernel) -> None:
    model = _load(tmp_path, "llama3")
    model.set_decode_kernel(kernel)
    before = fused_or_skip(model)
    model.to(torch.bfloat16)
    after = model.fused
    assert after is not None and after is not before
    w = after.weights
    assert w.dtype == torch.bfloat16
    assert _same(w.layers[0].qkv, model.model.decoder_layers[0].self_attn.qkv_weight)
    assert _same(w.embed, model.model.embed_tokens.weight)
    # prepacking after the kernel is set rebinds too: the many-row path needs the copies
    model.to(torch.float32)
    model.prepack_cpu_matmuls()
    assert model.fused is not None and model.fused.weights.layers[0].packed is not None
