"""Our paged Llama-family model against transformers' eager reference, logits row by row."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from backend.engine.attention import build_attention_batch
from backend.engine.kv_cache import allocate_kv_cache, kv_bytes_per_block, num_blocks_for_memory
from backend.engine.loader import load_model
from backend.engine.models import build_model
from modelfiles.model_config import ModelConfig
from tests.backend.engine.conftest_models import PagedRunner, hf_logits, save_hf_checkpoint

pytest.importorskip("transformers")

KINDS = ["llama3", "llama_tied", "mistral", "qwen2"]
TOL = 1e-4


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    out = tmp_path_factory.mktemp(request.param)
    return out, save_hf_checkpoint(request.param, out)


def _close(ours: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff <= tol, f"max abs diff {diff}"


def test_full_prefill_matches_hf(checkpoint: tuple[Path, Any]) -> None:
    path, hf = checkpoint
    loaded = load_model(path, torch.float32, torch.device("cpu"))
    toks = _tokens(40, 1)
    ref = hf_logits(hf, toks)
    assert ref.std() > 0.3  # the reference is not degenerate
    (ours,) = PagedRunner(loaded.model, loaded.config, block_size=8).step([(0, toks)])
    _close(ours, ref)


def test_chunked_prefill_then_paged_decode_matches_hf(checkpoint: tuple[Path, Any]) -> None:
    path, hf = checkpoint
    loaded = load_model(path, torch.float32, torch.device("cpu"))
    toks = _tokens(48, 2)
    ref = hf_logits(hf, toks)
    runner = PagedRunner(loaded.model, loaded.config, block_size=4, seed=7)
    rows = runner.step([(0, toks[:7])]) + runner.step([(0, toks[7:40])])
    rows += [runner.step([(0, [toks[i]])])[0] for i in range(40, 48)]
    table = runner.tables[0]
    assert table != sorted(table) and table != list(range(min(table), min(table) + len(table)))
    _close(torch.cat(rows), ref)


@pytest.mark.parametrize("packed", [False, True])
def test_mixed_batch_matches_hf(checkpoint: tuple[Path, Any], packed: bool) -> None:
    path, hf = checkpoint
    loaded = load_model(path, torch.float32, torch.device("cpu"))
    if packed:  # what the engine builder does on the CPU
        loaded.model.prepack_cpu_matmuls()
    a, b, c = _tokens(45, 3), _tokens(30, 4), _tokens(20, 5)
    refs = [hf_logits(hf, s) for s in (a, b, c)]
    runner = PagedRunner(loaded.model, loaded.config, block_size=8, seed=3)
    got: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}

    def run(work: list[tuple[int, list[int]]]) -> None:
        for (sid, _), rows in zip(work, runner.step(work)):
            got[sid].append(rows)

    run([(0, a[:40]), (2, c[:18])])  # two fresh prefills
    run([(0, [a[40]]), (1, b[:13])])  # decode + fresh prefill
    # prefill chunk with a cached prefix between two decodes: decode rows non-contiguous
    run([(2, [c[18]]), (1, b[13:29]), (0, [a[41]])])
    run([(1, [b[29]]), (0, [a[42]]), (2, [c[19]])])  # pure decode batch
    run([(0, a[43:45])])  # short chunk after decodes
    for sid, ref in enumerate(refs):
        _close(torch.cat(got[sid]), ref)


def test_sharded_checkpoint_loads_and_matches(tmp_path: Path) -> None:
    hf = save_hf_checkpoint("qwen2", tmp_path, seed=5, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = load_model(tmp_path, torch.float32, torch.device("cpu"))
    toks = _tokens(24, 6)
    (ours,) = PagedRunner(loaded.model, loaded.config).step([(0, toks)])
    _close(ours, hf_logits(hf, toks))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_fp32(tmp_path: Path, dtype: torch.dtype,
                                      packed: bool) -> None:
    hf = save_hf_checkpoint("llama3", tmp_path, seed=9)
    loaded = load_model(tmp_path, dtype, torch.device("cpu"))
    if packed:  # what the engine does on the CPU: multi-row steps use packed fp32 copies
        loaded.model.prepack_cpu_matmuls()
        assert loaded.model.lm_head_packed is not None
    assert loaded.model.model.embed_tokens.weight.dtype == dtype
    toks = _tokens(30, 8)
    ref = hf_logits(hf, toks)
    runner = PagedRunner(loaded.model, loaded.config, dtype=dtype, seed=1)
    rows = runner.step([(0, toks[:20])]) + runner.step([(0, toks[20:25])])
    rows += [runner.step([(0, [t])])[0] for t in toks[25:]]
    ours = torch.cat(rows)
    assert ours.dtype == torch.float32 and torch.isfinite(ours).all()
    _close(ours, ref, tol=0.15)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_fast_paths_match_plain_model(tmp_path: Path, dtype: torch.dtype) -> None:
    """Prepacked matmuls (fp32 activations for multi-row half steps) and the C decode
    kernel give the logits of the plain torch path, on mixed prefill + decode batches."""
    from backend.engine.decode_kernel import load_decode_kernel

    save_hf_checkpoint("llama3", tmp_path, seed=4)
    plain = load_model(tmp_path, dtype, torch.device("cpu"))
    fast = load_model(tmp_path, dtype, torch.device("cpu"))
    fast.model.prepack_cpu_matmuls()
    kernel = load_decode_kernel(tmp_path / "kernels")
    fast.model.set_decode_kernel(kernel)
    a, b, c = _tokens(30, 11), _tokens(20, 12), _tokens(12, 13)
    steps = [[(0, a[:25]), (1, b[:15])], [(0, [a[25]]), (1, [b[15]]), (2, c[:10])],
             [(0, [a[26]]), (2, [c[10]]), (1, [b[16]])], [(1, [b[17]])], [(0, [a[27]])]]
    runners = [PagedRunner(m.model, m.config, dtype=dtype, seed=5) for m in (plain, fast)]
    tol = 1e-4 if dtype == torch.float32 else 0.1
    for work in steps:
        ref, got = (torch.cat(r.step(work)) for r in runners)
        _close(got, ref, tol)
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_module_conversion_keeps_fused_weights_aliased(tmp_path: Path) -> None:
    save_hf_checkpoint("qwen2", tmp_path, seed=2)
    loaded = load_model(tmp_path, torch.float32, torch.device("cpu"))
    model: Any = loaded.model
    model.to(torch.bfloat16)
    attn = model.model.layers[0].self_attn
    assert attn.qkv_weight.dtype == torch.bfloat16
    attn.k_proj.weight.data.fill_(3.0)  # writes through the HF-named view
    q = loaded.config.q_size
    assert (attn.qkv_weight[q:q + loaded.config.kv_size] == 3.0).all()
    assert set(model.state_dict()) == set(dict(model.named_parameters()))


def test_kv_cache_sizing() -> None:
    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 10,
                               "hidden_size": 64, "intermediate_size": 16,
                               "num_hidden_layers": 3, "num_attention_heads": 4,
                               "num_key_value_heads": 2})
    per_block = kv_bytes_per_block(cfg, 16, torch.bfloat16)
    assert per_block == 3 * 2 * 2 * 16 * 16 * 2
    assert num_blocks_for_memory(cfg, 16, torch.bfloat16, 1.0) == (1 << 30) // per_block
    caches = allocate_kv_cache(cfg, 5, 16, torch.bfloat16, torch.device("cpu"))
    assert len(caches) == 3
    assert sum(k.nbytes + v.nbytes for k, v in caches) == 5 * per_block


def test_attention_batch_metadata() -> None:
    batch = build_attention_batch([([5, 2], 6, 1), ([9], 0, 3), ([1, 4], 3, 2)], 4, "cpu")
    assert batch.positions.tolist() == [6, 0, 1, 2, 3, 4]
    assert batch.slot_mapping.tolist() == [2 * 4 + 2, 36, 37, 38, 1 * 4 + 3, 4 * 4 + 0]
    assert batch.last_token_indices.tolist() == [0, 3, 5]
    assert batch.decode is not None and batch.decode.num_seqs == 1
    assert [p.start for p in batch.prefills] == [1, 4]
    from backend.engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        build_attention_batch([([0], 3, 2)], 4, "cpu")  # 5 tokens need 2 blocks


def test_init_weights_and_export_round_trip() -> None:
    cfg = ModelConfig.from_hf({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 50,
                               "hidden_size": 32, "intermediate_size": 64,
                               "num_hidden_layers": 1, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "tie_word_embeddings": True})
    model: Any = build_model(cfg, torch.float32, torch.device("cpu"))
    model.init_weights(seed=1)
    state = model.export_state_dict()
    assert "model.layers.0.self_attn.q_proj.bias" in state and "lm_head.weight" not in state
    assert "model.layers.0.self_attn.o_proj.bias" not in state
    ptrs = {t.untyped_storage().data_ptr() for t in state.values()}
    assert len(ptrs) == len(state)  # no shared storage: safetensors can save it
