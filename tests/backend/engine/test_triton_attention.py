"""The Triton paged decode-attention kernel (``triton_attention.py``), run on the CPU by
Triton's interpreter, against the torch path (gather + SDPA) on the same attention batch
the engine builds: GQA groups of 1, 3 and 4, head dims 64 and 48 (not a power of two),
block sizes 8 and 16, float32 and bfloat16 caches, decode rows mixed with a prefill chunk
(so their rows are not contiguous) and q as strided rows of a fused qkv; and the engine
with it gives the torch path's greedy tokens."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backend.engine import triton_attention
from backend.engine.attention import (
    Workspace,
    build_attention_batch,
    paged_attention,
    write_kv,
)
from backend.engine.builder import build_engine
from backend.engine.config import EngineConfig
from backend.engine.sampling import SamplingParams


@pytest.fixture(autouse=True)
def interpreted() -> None:
    """tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported."""
    assert triton_attention.available(torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"),
                         [(4, 4, 64, 16), (6, 2, 48, 8), (8, 2, 64, 16)])
def test_the_kernel_matches_the_torch_path(dtype: torch.dtype,
                                           heads: int, kv_heads: int, dim: int,
                                           block_size: int) -> None:
    rng = random.Random(heads * 100 + dim)
    g = torch.Generator().manual_seed(heads + dim)
    num_blocks = 64
    caches = [torch.randn(kv_heads, num_blocks, block_size, dim, generator=g).to(dtype)
              for _ in range(2)]
    free = list(range(num_blocks))
    rng.shuffle(free)
    specs = []
    for ctx in (1, block_size, block_size + 1, 3 * block_size - 2, 5 * block_size):
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        specs.append((table, ctx - 1, 1))
    # prefill chunks among them (the decode rows around them are not contiguous): a
    # short one after a cached prefix, a fresh one, and one of several 16-row tiles over
    # several blocks after a prefix
    specs.insert(2, ([free.pop() for _ in range(2)], 3, 5))
    specs.insert(4, ([free.pop() for _ in range(-(-7 // block_size))], 0, 7))
    specs.append(([free.pop() for _ in range(-(-45 // block_size))], 10, 35))
    batch = build_attention_batch(specs, block_size, "cpu")
    t = batch.num_tokens
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    q = qkv[:, :heads * dim].view(t, heads, dim)  # strided rows, as the model's
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(t, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(t, kv_heads, dim)
    scale = dim ** -0.5
    write_kv(*caches, k, v, batch)  # as the model does before attending
    want = paged_attention(q, k, v, *caches, batch, scale, Workspace())
    kernel = triton_attention.TritonDecodeAttention()
    assert kernel.supports(caches[0])
    got = paged_attention(q, k, v, *caches, batch, scale, Workspace(), kernel)
    assert got.dtype == dtype
    assert batch.decode is not None
    rows = batch.decode.tokens
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[rows].float(), want[rows].float(), atol=tol, rtol=tol)
    # the prefill rows too: the kernel's where blocks hold 16 tokens, SDPA's with 8
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_the_engine_on_the_kernel_gives_the_torch_paths_tokens(tmp_path: Path) -> None:
    def run(attention: str, decode_kernel: bool) -> list[list[int]]:
        core = build_engine(EngineConfig(
            model="tiny", cache_dir=str(tmp_path), device="cpu", dtype="float32",
            block_size=16, kv_blocks=64, attention=attention, decode_kernel=decode_kernel,
            fused_decode=False)).core
        if attention == "triton":
            assert isinstance(core.runner.model.decode_kernel,  # type: ignore[attr-defined]
                              triton_attention.TritonDecodeAttention)
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        for i in range(3):
            core.add_request(f"r{i}", list(range(3 + i, 14 + 3 * i)), params)
        out: dict[str, list[int]] = {}
        while core.has_work():
            for d in core.step():
                out.setdefault(d.request_id, []).extend(d.token_ids)
        return [out[f"r{i}"] for i in range(3)]

    assert run("triton", False) == run("auto", False)


COMPILE = """
import os, sys
os.environ.pop("TRITON_INTERPRET", None)  # compile, as on a GPU: not the interpreter
sys.path.insert(0, {root!r})
from backend.engine.triton_attention import compile_for
for args in [("bf16", 2, 64, 16), ("bf16", 3, 128, 16), ("fp32", 1, 48, 8)]:
    kernel = compile_for(90, *args)
    assert kernel.asm["cubin"], args
for args in [("bf16", 2, 64, 16), ("bf16", 3, 128, 16), ("fp32", 1, 48, 32)]:
    kernel = compile_for(90, *args, prefill=True)
    assert kernel.asm["cubin"], args
print("compiled")
"""


def test_the_kernel_compiles_for_hopper() -> None:
    """The interpreter runs kernels the compiler refuses (an annotation it cannot resolve,
    a shape it cannot lower): the kernel is compiled to sm_90 code here, no GPU needed."""
    root = str(Path(__file__).resolve().parents[3])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", COMPILE.format(root=root)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


def test_attention_triton_is_refused_where_triton_cannot_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from backend.engine.errors import InvalidRequestError
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU without the interpreter
    with pytest.raises(InvalidRequestError, match="attention=triton"):
        build_engine(EngineConfig(model="tiny", cache_dir=str(tmp_path), device="cpu",
                                  kv_blocks=16, attention="triton"))


def test_the_self_test_passes_here_and_names_a_broken_kernel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The builder runs the kernel once before using it; a kernel that fails (to compile,
    or to agree with the torch path) is named, and ``attention=triton`` refuses to start
    with it (``auto`` falls back to the torch path on CUDA)."""
    from backend.engine.errors import InvalidRequestError
    kernel = triton_attention.TritonDecodeAttention()
    for dtype in (torch.float32, torch.bfloat16):
        assert kernel.self_test(torch.device("cpu"), dtype) is None

    def wrong(self, q, k_cache, v_cache, tokens, tables, lens, scale, out):  # type: ignore[no-untyped-def]
        out.zero_()

    monkeypatch.setattr(triton_attention.TritonDecodeAttention, "__call__", wrong)
    assert "differs from the torch path" in str(kernel.self_test(torch.device("cpu"),
                                                                 torch.float32))
    with pytest.raises(InvalidRequestError, match="differs from the torch path"):
        build_engine(EngineConfig(model="tiny", cache_dir=str(tmp_path), device="cpu",
                                  kv_blocks=16, attention="triton"))
