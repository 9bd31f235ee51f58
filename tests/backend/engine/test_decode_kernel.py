"""The C decode-attention kernel equals the torch-ops path (gather + SDPA) it replaces."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from backend.engine.attention import Workspace, build_attention_batch, paged_attention
from backend.engine.decode_kernel import DecodeKernel, load_decode_kernel
from tests.backend.engine.conftest import no_compiler


def _case(dtype: torch.dtype, heads: int, kv_heads: int, dim: int, seed: int,
          prefill: bool) -> tuple[torch.Tensor, ...]:
    """A mixed step: decodes of random lengths on shuffled blocks, maybe a prefill chunk
    in between (so the decode rows are not contiguous)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    bs, num_blocks = 4, 64
    k_cache = torch.randn(kv_heads, num_blocks, bs, dim, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks, bs, dim, generator=gen).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    specs: list[tuple[list[int], int, int]] = []
    for i in range(5):
        if prefill and i == 2:
            specs.append(([free.pop() for _ in range(3)], 0, 9))
        ctx = rng.randint(1, 30)
        specs.append(([free.pop() for _ in range(-(-ctx // bs))], ctx - 1, 1))
    batch = build_attention_batch(specs, bs, "cpu")
    q = torch.randn(batch.num_tokens, heads, dim, generator=gen).to(dtype)
    new_k = torch.randn(batch.num_tokens, kv_heads, dim, generator=gen).to(dtype)
    return q, new_k, k_cache, v_cache, batch  # type: ignore[return-value]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"),
                         [(8, 4, 64), (4, 4, 16), (8, 2, 32), (8, 1, 16), (6, 2, 12)])
@pytest.mark.parametrize("prefill", [False, True])
def test_kernel_matches_torch_path(kernel: DecodeKernel, dtype: torch.dtype, heads: int,
                                   kv_heads: int, dim: int, prefill: bool) -> None:
    q, new_k, k_cache, v_cache, batch = _case(dtype, heads, kv_heads, dim, heads + dim,
                                              prefill)
    assert kernel.supports(k_cache)
    scale = dim ** -0.5
    ref = paged_attention(q, new_k, new_k, k_cache, v_cache, batch, scale, Workspace())
    got = paged_attention(q, new_k, new_k, k_cache, v_cache, batch, scale, Workspace(),
                          kernel)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: both round to bf16 at the end
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


def test_strided_fp32_queries(kernel: DecodeKernel) -> None:
    """The model passes q as a view into the fused qkv rows (token stride > H * D)."""
    q, new_k, k_cache, v_cache, batch = _case(torch.float32, 8, 4, 16, 3, False)
    wide = torch.cat([q, torch.randn(q.shape[0], 4, 16)], dim=1)[:, :8]
    assert not wide.is_contiguous()
    ref = paged_attention(q, new_k, new_k, k_cache, v_cache, batch, 0.25, Workspace())
    got = paged_attention(wide, new_k, new_k, k_cache, v_cache, batch, 0.25, Workspace(),
                          kernel)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_half_caches_are_left_to_torch(kernel: DecodeKernel) -> None:
    assert not kernel.supports(torch.zeros(2, 2, 4, 8, dtype=torch.float16))


def test_build_is_cached(tmp_path: Path) -> None:
    first = load_decode_kernel(tmp_path)
    if first is None:
        no_compiler()
    libs = list(tmp_path.glob("*.so"))
    assert len(libs) == 1
    mtime = libs[0].stat().st_mtime_ns
    assert load_decode_kernel(tmp_path) is not None
    assert libs[0].stat().st_mtime_ns == mtime  # loaded, not rebuilt


def test_loading_the_kernel_keeps_subnormal_floats(tmp_path: Path) -> None:
    """-ffast-math at link time would add crtfastmath's constructor, which turns on
    flush-to-zero / denormals-are-zero for the whole process when the library loads."""
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path\n"
            "from backend.engine.decode_kernel import load_decode_kernel\n"
            f"k = load_decode_kernel(Path({str(tmp_path)!r}))\n"
            "x = float(sys.argv[1])\n"
            "print(k is not None, x / 4 != 0.0)\n")
    out = subprocess.run([sys.executable, "-c", code, "5e-310"], check=True,
                         capture_output=True, text=True, timeout=180).stdout.split()
    if out[0] != "True":
        no_compiler()
    assert out[1] == "True", "the kernel's library turned on flush-to-zero"
