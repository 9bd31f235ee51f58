"""Attention over a flat batch of tokens from many sequences, with a paged KV cache.

A step's tokens are laid out flat (``[T, ...]``) in the order the caller gives the
sequences. ``build_attention_batch`` turns (block table, computed, new) triples into
index tensors ONCE per step; every layer reuses them, so a layer costs a fixed handful
of tensor ops whatever the batch looks like:

- every new token's K/V is written with one ``index_copy_`` (``slot_mapping``);
- all sequences with exactly one new token (decodes) form one group: their blocks are
  gathered with one ``index_select`` into ``[kv_heads, B, L, head_dim]`` and attended
  with two batched matmuls and a padding mask;
- each sequence with several new tokens (a prefill chunk) runs one
  ``scaled_dot_product_attention`` against its cached + new keys, causal with an offset.

Kernel choices are measured on a 2-core AVX2 CPU without bf16/fp16 hardware: on the CPU
decode attention runs ``decode_kernel.py``'s C kernel, which reads the blocks in place
(~3x faster than gather + SDPA at batch 32). Without it (no compiler, fp16 caches, GPU)
decode attention reads bf16/fp32 K/V natively through SDPA with the GQA groups folded
into query rows (SDPA's own ``enable_gqa`` and fp16 paths are ~6x slower there, so fp16
K/V is widened to fp32 first); prefill chunks run in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.nn.functional as F

from .errors import InvalidRequestError

if TYPE_CHECKING:
    from .fused_decode import FusedDecoder


class PagedDecodeKernel(Protocol):
    """A decode-attention kernel over the paged cache: the CPU's C one
    (``decode_kernel.DecodeKernel``) or CUDA's Triton one
    (``triton_attention.TritonDecodeAttention``)."""

    # True: reads q and writes out in their own dtype; False: float32 q and out only
    native_dtypes: bool

    def supports(self, cache: torch.Tensor) -> bool: ...

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                chunk: PrefillChunk, scale: float, out: torch.Tensor) -> bool:
        """Attend one prefill chunk's rows of q over its cached + new keys (all in the
        cache by now) into its rows of out; False: not supported here (SDPA instead)."""
        ...

    def fused_decoder(self, weights: Any) -> FusedDecoder | None: ...

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tokens: torch.Tensor, tables: torch.Tensor, context_lens: torch.Tensor,
                 scale: float, out: torch.Tensor) -> None: ...

SeqSpec = tuple[list[int], int, int]  # (block_table, num_computed_tokens, num_new_tokens)


class Workspace:
    """Grow-only scratch buffers reused across layers and steps.

    Why: a fresh multi-MB CPU tensor is mmapped and page-faulted on every allocation
    (a 64 MiB fp32 temporary costs ~8x its copy time). A buffer is valid only until the
    next ``get`` of the same name; callers use it within one layer's few ops.
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        buf = self._bufs.get((name, dtype))
        if buf is None or buf.numel() < numel or buf.device != device:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._bufs[(name, dtype)] = buf
        return buf[:numel].view(shape)


@dataclass(slots=True)
class DecodeGroup:
    """Sequences with exactly one new token, attended together."""

    num_seqs: int
    token_range: tuple[int, int] | None  # their flat token indices when contiguous
    token_indices: torch.Tensor | None  # [B] int64 otherwise
    tokens: torch.Tensor  # [B] int64: flat token index of each (both cases)
    block_ids: torch.Tensor  # [B * blocks_per_seq] int64; short tables padded with block 0
    blocks_per_seq: int
    context_lens: torch.Tensor  # [B] int64
    # Computed at first use (every layer's cache has the same shape), only by the torch
    # path: the padding mask [1, B, 1, L] (True for key positions < context length), and
    # block_ids offset per KV head into the [kv_heads * num_blocks, ...] view of a cache,
    # so one dim-0 gather yields [kv_heads, B, L, D] contiguous.
    mask: torch.Tensor | None = None
    flat_ids: torch.Tensor | None = None


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's run of several new tokens (flat indices start .. start+num_new-1)."""

    start: int
    num_new: int
    num_computed: int
    block_ids: torch.Tensor | None  # [n_blocks] covering the context; None if nothing cached
    mask: torch.Tensor | None  # [num_new, ctx] bool (True = may attend); None = plain causal
    table: list[int] = field(default_factory=list)  # the context's blocks (a kernel's)


@dataclass(slots=True)
class AttentionBatch:
    """Per-step metadata, every tensor already on the model's device."""

    num_tokens: int
    block_size: int
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot each new token's K/V goes to
    last_token_indices: torch.Tensor  # [S] int64: flat index of each sequence's last new token
    decode: DecodeGroup | None
    prefills: list[PrefillChunk] = field(default_factory=list)


def build_attention_batch(
    seqs: list[SeqSpec], block_size: int, device: torch.device | str
) -> AttentionBatch:
    """Precompute positions, cache slots and per-group gather indices for one step."""
    if not seqs:
        raise InvalidRequestError("an attention batch needs at least one sequence")
    positions: list[int] = []
    slots: list[int] = []
    last: list[int] = []
    dec_tokens: list[int] = []
    dec_tables: list[list[int]] = []
    dec_ctx: list[int] = []
    prefill_specs: list[tuple[int, int, int, list[int]]] = []
    for block_table, computed, new in seqs:
        ctx = computed + new
        if new < 1 or computed < 0:
            raise InvalidRequestError(f"bad sequence spec: computed={computed} new={new}")
        n_blocks = -(-ctx // block_size)
        if len(block_table) < n_blocks:
            raise InvalidRequestError(
                f"block table has {len(block_table)} blocks; {ctx} tokens need {n_blocks}"
            )
        start = len(positions)
        for pos in range(computed, ctx):
            positions.append(pos)
            slots.append(block_table[pos // block_size] * block_size + pos % block_size)
        last.append(len(positions) - 1)
        if new == 1:
            dec_tokens.append(start)
            dec_tables.append(block_table[:n_blocks])
            dec_ctx.append(ctx)
        else:
            prefill_specs.append((start, new, computed, block_table[:n_blocks]))

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

    decode = None
    if dec_tokens:
        decode = _decode_group(dec_tokens, dec_tables, dec_ctx, block_size, device)
    prefills = []
    for start, new, computed, table in prefill_specs:
        block_ids = mask = None
        if computed > 0:
            block_ids = as_tensor(table)
            q_pos = torch.arange(computed, computed + new).unsqueeze(1)
            # token at position p sees keys 0..p (cached prefix + new tokens up to itself)
            mask = (torch.arange(computed + new).unsqueeze(0) <= q_pos).to(device)
        prefills.append(PrefillChunk(start, new, computed, block_ids, mask, table))
    return AttentionBatch(
        num_tokens=len(positions),
        block_size=block_size,
        positions=as_tensor(positions),
        slot_mapping=as_tensor(slots),
        last_token_indices=as_tensor(last),
        decode=decode,
        prefills=prefills,
    )


def _decode_group(
    tokens: list[int],
    tables: list[list[int]],
    ctx_lens: list[int],
    block_size: int,
    device: torch.device | str,
) -> DecodeGroup:
    n = len(tokens)
    width = max(len(t) for t in tables)
    # Padding reads block 0, which always exists; the mask hides whatever it holds.
    flat = [b for t in tables for b in (t + [0] * (width - len(t)))]
    contiguous = tokens == list(range(tokens[0], tokens[0] + n))
    token_t = torch.tensor(tokens, dtype=torch.int64).to(device)
    return DecodeGroup(
        num_seqs=n,
        token_range=(tokens[0], tokens[0] + n) if contiguous else None,
        token_indices=None if contiguous else token_t,
        tokens=token_t,
        block_ids=torch.tensor(flat, dtype=torch.int64).to(device),
        blocks_per_seq=width,
        context_lens=torch.tensor(ctx_lens, dtype=torch.int64).to(device),
    )


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    batch: AttentionBatch,
) -> None:
    """Store the step's new K/V ([T, kv_heads, head_dim]) into their cache slots."""
    heads, _, _, dim = k_cache.shape
    k_cache.view(heads, -1, dim).index_copy_(1, batch.slot_mapping, k.transpose(0, 1))
    v_cache.view(heads, -1, dim).index_copy_(1, batch.slot_mapping, v.transpose(0, 1))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    ws: Workspace,
    kernel: PagedDecodeKernel | None = None,
) -> torch.Tensor:
    """Attend q [T, H, D] over each sequence's cached + new keys; returns [T, H*D].

    Precondition: ``write_kv`` already stored this step's k/v, so the cache holds every
    key a token may see. ``kernel``: a decode kernel (the CPU's C one, CUDA's Triton
    one), used where it supports the cache.
    """
    num_tokens, num_heads, dim = q.shape
    out = torch.empty((num_tokens, num_heads * dim), dtype=q.dtype, device=q.device)
    if batch.decode is not None:
        if kernel is not None and kernel.supports(k_cache):
            _decode_attention_kernel(kernel, q, k_cache, v_cache, batch.decode, scale, out,
                                     ws)
        else:
            _decode_attention(q, k_cache, v_cache, batch.decode, scale, out, ws)
    for chunk in batch.prefills:
        if kernel is None or not kernel.supports(k_cache) \
                or not kernel.prefill(q, k_cache, v_cache, chunk, scale, out):
            _prefill_attention(q, k, v, k_cache, v_cache, chunk, scale, out)
    return out


def _decode_attention_kernel(
    kernel: PagedDecodeKernel, q: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, group: DecodeGroup, scale: float, out: torch.Tensor,
    ws: Workspace,
) -> None:
    tables = group.block_ids.view(group.num_seqs, group.blocks_per_seq)
    # q may be a strided view (rows of the fused qkv)
    if q.dtype == torch.float32 or kernel.native_dtypes:
        kernel(q, k_cache, v_cache, group.tokens, tables, group.context_lens, scale, out)
        return
    out32 = ws.get("attn_out32", tuple(out.shape), torch.float32, out.device)
    kernel(q.float(), k_cache, v_cache, group.tokens, tables, group.context_lens, scale,
           out32)
    rng = group.token_range
    if rng is not None:
        out[rng[0]:rng[1]].copy_(out32[rng[0]:rng[1]])
    else:
        out.index_copy_(0, group.tokens, out32.index_select(0, group.tokens).to(out.dtype))


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup,
    scale: float, out: torch.Tensor, ws: Workspace,
) -> None:
    kv_heads, num_blocks, block_size, dim = k_cache.shape
    n, num_heads = group.num_seqs, q.shape[1]
    groups = num_heads // kv_heads
    length = group.blocks_per_seq * block_size
    if group.flat_ids is None:
        heads = torch.arange(kv_heads, device=k_cache.device).unsqueeze(1) * num_blocks
        group.flat_ids = (heads + group.block_ids.unsqueeze(0)).view(-1)
    if group.mask is None:
        key_pos = torch.arange(length, device=k_cache.device).unsqueeze(0)
        group.mask = (key_pos < group.context_lens.unsqueeze(1)).view(1, n, 1, -1)
    # SDPA's batch dims are (kv_heads, B): the gathered K/V are contiguous as they are.
    keys = _gather(k_cache, group.flat_ids, ws, "k").view(kv_heads, n, length, dim)
    values = _gather(v_cache, group.flat_ids, ws, "v").view(kv_heads, n, length, dim)
    rng, idx = group.token_range, group.token_indices  # invariant: exactly one is set
    q_dec = q[rng[0]:rng[1]] if rng is not None else q.index_select(0, cast(torch.Tensor, idx))
    # Query head h uses KV head h // groups (HF repeat_kv order): fold the groups into
    # query rows, so K/V are read once per KV head and never expanded.
    q_dec = q_dec.view(n, kv_heads, groups, dim).transpose(0, 1).to(keys.dtype)
    o = F.scaled_dot_product_attention(
        q_dec, keys, values, attn_mask=group.mask, scale=scale,
    ).transpose(0, 1)  # [B, kv_heads, G, D]
    if rng is not None:
        out[rng[0]:rng[1]].view(n, kv_heads, groups, dim).copy_(o)
    else:
        out.index_copy_(0, cast(torch.Tensor, idx), o.reshape(n, -1).to(out.dtype))


def _gather(cache: torch.Tensor, flat_ids: torch.Tensor, ws: Workspace,
            name: str) -> torch.Tensor:
    """Blocks ``flat_ids`` of the [kv_heads * num_blocks, bs, D] view, into scratch.

    A dim-0 gather copies whole blocks (~4x faster on CPU than gathering along dim 1).
    bf16 and fp32 stay as they are (CPU SDPA handles them well); fp16 SDPA on CPU is
    ~6x slower than fp32, so fp16 is widened.
    """
    heads, num_blocks, block_size, dim = cache.shape
    shape = (flat_ids.numel(), block_size, dim)
    native = torch.index_select(cache.view(heads * num_blocks, block_size, dim), 0, flat_ids,
                                out=ws.get(name, shape, cache.dtype, cache.device))
    if cache.dtype != torch.float16 or cache.device.type != "cpu":
        return native
    return ws.get(name + "32", shape, torch.float32, cache.device).copy_(native)


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, chunk: PrefillChunk, scale: float, out: torch.Tensor,
) -> None:
    kv_heads, _, _, dim = k_cache.shape
    lo, hi = chunk.start, chunk.start + chunk.num_new
    q_i = q[lo:hi].transpose(0, 1).float().unsqueeze(0)  # [1, H, n, D]
    if chunk.block_ids is None:  # nothing cached: keys are exactly this chunk's
        keys = k[lo:hi].transpose(0, 1)
        values = v[lo:hi].transpose(0, 1)
    else:
        ctx = chunk.num_computed + chunk.num_new
        keys = k_cache.index_select(1, chunk.block_ids).view(kv_heads, -1, dim)[:, :ctx]
        values = v_cache.index_select(1, chunk.block_ids).view(kv_heads, -1, dim)[:, :ctx]
    o = F.scaled_dot_product_attention(
        q_i, keys.float().unsqueeze(0), values.float().unsqueeze(0),
        attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=scale, enable_gqa=True,
    )  # [1, H, n, D]
    out[lo:hi].view(chunk.num_new, -1, dim).copy_(o[0].transpose(0, 1))
