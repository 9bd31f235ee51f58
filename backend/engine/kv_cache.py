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

import torch

from .model_config import ModelConfig

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
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(config.num_hidden_layers)
    ]


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
