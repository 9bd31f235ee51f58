"""Paged attention on CUDA: Triton kernels of our own over the block table, for decode
rows and for prefill chunks.

One program per (decode sequence, KV head): it loads the sequence's query rows of that KV
head's group (GQA: ``H / kv_heads`` query heads share each K/V block read), walks the
sequence's block table one KV block at a time, and keeps an online softmax (running max,
running sum, float32 accumulator), so K/V are read once, in place, in the cache's dtype,
and nothing is gathered or padded: the work follows each sequence's own context length.
The query is read at its flat row (``tokens``) and the output written there, in the
activations' dtype, so the model's decode rows need no copy before or after.

Used by the engine on CUDA when Triton imports (``EngineConfig(attention="auto")``, or
``"triton"`` to require it; ``"torch"`` keeps the gather + SDPA path, which every machine
has). Tested on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``,
``tests/backend/engine/test_triton_attention.py``), against the torch path, with the
same inputs the engine gives it.

A prefill chunk (``_paged_prefill``, one launch per chunk) runs one program per (tile of
16 query rows, query head): the keys each row may see (its cached prefix and the chunk's
rows up to its own, causal) stream from the cache block by block through ``tl.dot`` with
an online softmax, in float32 operands (tf32 on the tensor cores for half caches, IEEE for
float32 ones). Blocks of fewer than 16 tokens (``tl.dot``'s least) leave the chunk to
SDPA over its gathered context.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .attention import PrefillChunk

try:  # Triton ships with CUDA builds of torch; the CPU machines do without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None


def available(device: torch.device) -> bool:
    """Triton imports and can run on ``device`` (CUDA; any device in interpreter mode)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if triton is not None:
    # Only tl.constexpr annotations: compiling (not the interpreter) resolves every
    # annotation as a global of the kernel's and refuses the others (``compile_for``).
    @triton.jit  # type: ignore[untyped-decorator]
    def _paged_decode(  # type: ignore[no-untyped-def]
        q_ptr, k_ptr, v_ptr, out_ptr, tokens_ptr, tables_ptr, lens_ptr,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_table, num_blocks, scale,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        token = tl.load(tokens_ptr + seq)
        ctx = tl.load(lens_ptr + seq)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        t = tl.arange(0, BLOCK_SIZE)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        heads = kvh * GROUP + g
        q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        q = q * scale
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        # cache layout [kv_heads, num_blocks, BLOCK_SIZE, HEAD_DIM], contiguous
        head_base = kvh.to(tl.int64) * num_blocks * BLOCK_SIZE * HEAD_DIM
        for start in range(0, ctx, BLOCK_SIZE):
            block = tl.load(tables_ptr + seq * stride_table + start // BLOCK_SIZE)
            offs = head_base + block.to(tl.int64) * BLOCK_SIZE * HEAD_DIM \
                + t[:, None] * HEAD_DIM + d[None, :]
            t_ok = (start + t) < ctx
            kv_mask = t_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [BLOCK_G, BLOCK_SIZE]
            s = tl.where(t_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        o = acc / l_i[:, None]
        tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


    @triton.jit  # type: ignore[untyped-decorator]
    def _paged_prefill(  # type: ignore[no-untyped-def]
        q_ptr, k_ptr, v_ptr, out_ptr, table_ptr,
        stride_qt, stride_qh, stride_ot, stride_oh,
        start, num_new, computed, num_blocks, scale,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr,
    ):
        """One prefill chunk: a tile of BLOCK_M of its query rows x one query head, over
        the keys each row may see (causal: positions up to its own), from the cache."""
        tile = tl.program_id(0)
        head = tl.program_id(1)
        kvh = head // GROUP
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        t = tl.arange(0, BLOCK_SIZE)
        row_ok = rows < num_new
        d_ok = d < HEAD_DIM
        # float32 operands: tf32 tensor cores for half caches (IEEE for float32 ones);
        # Triton's interpreter multiplies bf16 tiles as raw bits, so no bf16 dot here
        q = tl.load(q_ptr + (start + rows)[:, None] * stride_qt + head * stride_qh
                    + d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)
        pos = computed + rows  # each row's position; it sees keys 0..pos
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        head_base = kvh.to(tl.int64) * num_blocks * BLOCK_SIZE * HEAD_DIM
        last = tl.minimum(computed + (tile + 1) * BLOCK_M, computed + num_new)
        for key0 in range(0, last, BLOCK_SIZE):
            block = tl.load(table_ptr + key0 // BLOCK_SIZE)
            offs = head_base + block.to(tl.int64) * BLOCK_SIZE * HEAD_DIM \
                + t[:, None] * HEAD_DIM + d[None, :]
            k = tl.load(k_ptr + offs, mask=d_ok[None, :], other=0.0).to(tl.float32)
            v = tl.load(v_ptr + offs, mask=d_ok[None, :], other=0.0).to(tl.float32)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            seen = (key0 + t)[None, :] <= pos[:, None]
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p, v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        o = acc / l_i[:, None]
        tl.store(out_ptr + (start + rows)[:, None] * stride_ot + head * stride_oh
                 + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


PREFILL_TILE = 16  # query rows a prefill program takes (tl.dot's least)


def _decode_consts(group: int, dim: int, block_size: int) -> dict[str, int]:
    """``_paged_decode``'s compile-time arguments (its launch and ``compile_for``)."""
    return {"GROUP": group, "BLOCK_G": _next_pow2(group), "HEAD_DIM": dim,
            "BLOCK_D": _next_pow2(dim), "BLOCK_SIZE": block_size}


def _prefill_consts(group: int, dim: int, block_size: int, ieee: bool) -> dict[str, int]:
    """``_paged_prefill``'s compile-time arguments (its launch and ``compile_for``)."""
    return {"GROUP": group, "HEAD_DIM": dim, "BLOCK_D": _next_pow2(max(dim, 16)),
            "BLOCK_M": PREFILL_TILE, "BLOCK_SIZE": block_size, "IEEE": int(ieee)}


class TritonDecodeAttention:
    """The decode-attention kernel the model calls where ``supports`` says so
    (``attention.paged_attention``); the same call as the CPU ``DecodeKernel``."""

    native_dtypes = True  # reads q and writes out in their own dtype (no float32 copies)

    def supports(self, cache: torch.Tensor) -> bool:
        return available(cache.device) and cache.is_contiguous() \
            and cache.dtype in (torch.float32, torch.bfloat16, torch.float16)

    def self_test(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """None when the kernel compiles here and agrees with the torch path on a small
        batch (GQA, two sequences across blocks); else what went wrong. The builder runs it
        before using the kernel, and falls back to the torch path on an answer."""
        from .attention import Workspace, build_attention_batch, paged_attention
        try:
            g = torch.Generator().manual_seed(0)
            k_cache, v_cache = (torch.randn(2, 8, 16, 64, generator=g).to(device, dtype)
                                for _ in range(2))
            # two decodes and a prefill chunk after a cached prefix (both read the cache)
            batch = build_attention_batch([([3, 5], 20, 1), ([6], 4, 1), ([1, 2], 10, 8)],
                                          16, device)
            q = torch.randn(10, 4, 64, generator=g).to(device, dtype)
            kv = torch.zeros(10, 2, 64, device=device, dtype=dtype)  # read from the cache
            want = paged_attention(q, kv, kv, k_cache, v_cache, batch, 0.125, Workspace())
            got = paged_attention(q, kv, kv, k_cache, v_cache, batch, 0.125, Workspace(),
                                  self)
            err = float((got.float() - want.float()).abs().max())
        except Exception as exc:  # noqa: BLE001 - any failure means "do not use it"
            return repr(exc)
        if not err < (1e-3 if dtype == torch.float32 else 3e-2):
            return f"differs from the torch path by {err}"
        return None

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                chunk: PrefillChunk, scale: float, out: torch.Tensor) -> bool:
        """One prefill chunk over its block table (``_paged_prefill``); False where the
        blocks are smaller than ``tl.dot``'s 16 rows (SDPA runs the chunk then)."""
        kv_heads, num_blocks, block_size, dim = k_cache.shape
        if block_size < 16 or q.stride(2) != 1:
            return False
        heads = q.shape[1]
        table = torch.tensor(chunk.table, dtype=torch.long).to(q.device, non_blocking=True)
        grid = (-(-chunk.num_new // PREFILL_TILE), heads)
        _paged_prefill[grid](
            q, k_cache, v_cache, out, table,
            q.stride(0), q.stride(1), out.stride(0), dim,
            chunk.start, chunk.num_new, chunk.num_computed, num_blocks, scale,
            **_prefill_consts(heads // kv_heads, dim, block_size, q.dtype == torch.float32),
        )
        return True

    def fused_decoder(self, weights: Any) -> None:
        """No fused whole-step decoder on this path (the CPU kernel's)."""
        return

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tokens: torch.Tensor, tables: torch.Tensor, context_lens: torch.Tensor,
                 scale: float, out: torch.Tensor) -> None:
        """Attend decode rows ``tokens`` of q [T, H, D] (rows may be strided, D
        contiguous) over their paged K/V; write out [T, H * D] at those rows.
        ``tables`` [n, width] int64 (padded), ``context_lens`` [n] int64."""
        kv_heads, num_blocks, block_size, dim = k_cache.shape
        if q.stride(2) != 1 or not tables.is_contiguous():
            raise ValueError("q's head dim and the block tables must be contiguous")
        grid = (tokens.shape[0], kv_heads)
        _paged_decode[grid](
            q, k_cache, v_cache, out, tokens, tables, context_lens,
            q.stride(0), q.stride(1), out.stride(0), dim, tables.stride(0),
            num_blocks, scale, **_decode_consts(q.shape[1] // kv_heads, dim, block_size),
        )


def compile_for(arch: int, dtype: str, group: int, head_dim: int, block_size: int,
                prefill: bool = False) -> Any:
    """Compile the kernel for CUDA compute capability ``arch`` (90: Hopper) without a GPU:
    what ``tests/backend/engine/test_triton_attention.py`` checks in a process without
    ``TRITON_INTERPRET`` (the interpreter accepts kernels the compiler refuses).
    ``dtype``: Triton's name of the q/cache/out element type (``bf16``, ``fp32``).
    ``prefill``: the prefill kernel rather than the decode one."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    indexes: tuple[str, ...]
    ints: tuple[str, ...]
    if prefill:
        fn, indexes = _paged_prefill, ("table_ptr",)
        ints = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "start", "num_new",
                "computed", "num_blocks")
        consts = _prefill_consts(group, head_dim, block_size, dtype == "fp32")
    else:
        fn, indexes = _paged_decode, ("tokens_ptr", "tables_ptr", "lens_ptr")
        ints = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_table",
                "num_blocks")
        consts = _decode_consts(group, head_dim, block_size)
    signature = {**{n: f"*{dtype}" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")},
                 **{n: "*i64" for n in indexes}, **{n: "i32" for n in ints},
                 "scale": "fp32", **{n: "constexpr" for n in consts}}
    source = ASTSource(fn, signature=signature,
                       constexprs={(fn.arg_names.index(n),): v for n, v in consts.items()})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32))
