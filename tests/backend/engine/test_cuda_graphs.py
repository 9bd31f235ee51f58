"""Decode steps through the CUDA graphs' static buffers (``cuda_graphs.py``), run eagerly
on the CPU (``build_engine(static_decode=True)``; the capture itself needs a GPU:
``scripts/gpu-check.sh``): batch-size buckets with padding rows, the scratch block those
rows write into, block tables at their widest with stale columns, on the torch attention
path and on the Triton kernel (interpreted). The tokens must be the plain engine's."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.engine.builder import EngineParts, build_engine
from backend.engine.config import EngineConfig
from backend.engine.sampling import SamplingParams


def make(cache: Path, static: bool, **kw: object) -> EngineParts:
    base: dict[str, object] = {"model": "tiny", "cache_dir": str(cache), "device": "cpu",
                               "dtype": "float32", "block_size": 8, "kv_blocks": 96,
                               "max_model_len": 160, "max_num_seqs": 8,
                               "max_num_batched_tokens": 64, "decode_kernel": False,
                               "fused_decode": False}
    base.update(kw)
    return build_engine(EngineConfig(**base), static_decode=static)  # type: ignore[arg-type]


def run(parts: EngineParts, n: int) -> dict[str, list[int]]:
    """``n`` requests arriving over time, so decode batches take every size from 1 to n
    (padded to their buckets), with contexts across several blocks."""
    core = parts.core
    out: dict[str, list[int]] = {}
    for i in range(n):
        params = SamplingParams(max_tokens=4 * n + 2 - 2 * i, ignore_eos=True,
                                temperature=0 if i % 2 else 0.9, seed=i)
        core.add_request(f"r{i}", [3 + i] * (5 + 9 * i), params)
        for _ in range(3):
            for d in core.step():
                out.setdefault(d.request_id, []).extend(d.token_ids)
    while core.has_work():
        for d in core.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    return out


# Triton's interpreter takes ~25 ms a program: three requests there (buckets 1, 2, 4)
@pytest.mark.parametrize(("attention", "n"), [("torch", 7), ("triton", 3)])
def test_static_decode_steps_give_the_plain_steps_tokens(tmp_path: Path, attention: str,
                                                         n: int) -> None:
    parts = make(tmp_path, True, attention=attention)
    graphs = parts.runner.graphs
    assert graphs is not None and graphs.buckets == [1, 2, 4, 8]
    assert parts.runner.kv_caches[0][0].shape[1] == parts.num_blocks + 1  # the scratch
    assert graphs.scratch_block == parts.num_blocks
    sizes: list[int] = []
    inner = graphs.run

    def counted(chunks):  # type: ignore[no-untyped-def]
        sizes.append(len(chunks))
        return inner(chunks)

    graphs.run = counted  # type: ignore[method-assign]
    static = run(parts, n)
    plain = run(make(tmp_path, False, attention=attention), n)
    assert set(range(1, n + 1)) <= set(sizes)  # every batch size, padded to its bucket
    assert static == plain
    assert len(static) == n


def test_a_step_with_a_prefill_chunk_runs_eagerly(tmp_path: Path) -> None:
    parts = make(tmp_path, True)
    graphs = parts.runner.graphs
    assert graphs is not None
    core = parts.core
    core.add_request("a", [5] * 20, SamplingParams(max_tokens=4, temperature=0))
    out = core.scheduler.schedule()
    assert not graphs.fits(out.chunks)  # a prefill chunk: the plain step
    core.scheduler.on_step_done(out, 0.0, 0.0)
