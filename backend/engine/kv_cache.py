"""Paged KV cache tensors: allocation and sizing.

One (K, V) pair per layer; K and V have the same layout, heads outermost::

    K[layer] : [num_kv_heads, num_blocks, block_size, head_dim]

               block 0          block 1                 block N-1
    head 0   [ s0 s1 .. s15 ] [ s0 s1 .. s15 ]  ...  [ s0 .. s15 ]   each s = head_dim values
    head 1   [ s0 s1 .. s15 ] [ s0 s1 .. s15 ]  ...  [ s0 .. s15 ]
    ...

A token at position ``p`` of a sequence with block table ``bt`` lives in slot
``bt[p // block_size] * block_size + p % block_size`` of the flattened
``[num_kv_heads, num_blocks * block_size, head_dim]`` view.

Why heads outermost: gathering a batch's blocks with one ``index_select`` along dim 1
yields ``[num_kv_heads, B * blocks_per_seq, block_size, head_dim]``, which is already the
contiguous ``[kv_heads, B, L, head_dim]`` operand the attention matmuls want; no
transpose copy per layer.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

from modelfiles.model_config import ModelConfig

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> KVCache:
    """Zero-filled K and V tensors for every layer (zeros keep padded reads finite)."""
    shape = (config.num_key_value_heads, num_blocks, block_size, config.head_dim)
    return [(_zeros(shape, dtype, device), _zeros(shape, dtype, device))
            for _ in range(config.num_hidden_layers)]


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """On Linux CPUs, the cache is asked to live in 2 MiB pages before it is first touched.

    Why: decode attention reads each sequence's blocks wherever they lie; with 4 KiB
    pages nearly every block read is a TLB miss (measured: the decode kernel ran 1.4x
    faster on randomly placed blocks with huge pages). Advisory: without transparent huge
    pages it changes nothing.
    """
    t = torch.empty(shape, dtype=dtype, device=device)
    if device.type == "cpu" and sys.platform == "linux" and t.nbytes >= 2 * _HUGE_PAGE:
        start = -(-t.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
        end = (t.data_ptr() + t.nbytes) // _HUGE_PAGE * _HUGE_PAGE
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
    return t.zero_()


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V together."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * config.num_key_value_heads * block_size * config.head_dim * elem
    return per_layer * config.num_hidden_layers


def num_blocks_for_memory(
    config: ModelConfig, block_size: int, dtype: torch.dtype, gib: float
) -> int:
    """How many whole blocks fit in ``gib`` GiB."""
    return int(gib * (1 << 30)) // kv_bytes_per_block(config, block_size, dtype)
