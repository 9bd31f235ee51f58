"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, captured at
start-up, replayed when every chunk of a step decodes one token and the batch fits.

A decode step on a GPU is mostly launch overhead at small batches: each layer is a dozen
kernels of microseconds each, launched one by one from Python. A graph launches them all
at once. What a graph replays is fixed at capture (shapes and addresses), so the step's
inputs live in static buffers, sized for the largest bucket, that each step fills
(host-to-device copies) before the replay:

- token ids, positions, the cache slot of each new token's K/V;
- the block tables at their widest (``max_model_len / block_size`` blocks; a step fills
  the columns its longest context uses, and the kernel reads only each row's
  ``context_len`` keys, so older ids past them are never read);
- the context lengths.

A step of n sequences runs the smallest bucket b >= n; its b - n padding rows have
context length 1 and write their K/V into a scratch block kept out of the block manager
(one block more in the cache), so they never touch a live sequence's blocks. The logits
of the n real rows are read from the graph's own output buffer.

The attention must read the block table in place (``triton_attention``): the torch path
gathers blocks into buffers sized by the step's widest table, which a graph cannot follow.
``EngineConfig(cuda_graphs=False)`` turns graphs off. With ``capture=False`` the same
static-buffer step runs eagerly: how the CPU tests check the padding, the scratch block
and the buckets against the plain step (``tests/backend/engine/test_cuda_graphs.py``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from .attention import AttentionBatch, DecodeGroup
from .scheduler import ScheduledChunk

if TYPE_CHECKING:
    from .models import CausalLM

log = logging.getLogger("sluice.engine")

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device, max_batch: int, max_model_len: int,
                 scratch_block: int, capture: bool = True) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.max_batch = min(max_batch, BUCKETS[-1])
        self.buckets = [b for b in BUCKETS if b < self.max_batch] + [self.max_batch]
        self.width = -(-max_model_len // block_size)
        n, long = self.max_batch, torch.long
        self.ids = torch.zeros(n, dtype=long, device=device)
        self.positions = torch.zeros(n, dtype=long, device=device)
        # until a step fills them, every row is a padding row: the capture's warm-up
        # writes its K/V into the scratch block, not into a block the manager hands out
        self.slots = torch.full((n,), scratch_block * block_size, dtype=long, device=device)
        self.tables = torch.zeros(n, self.width, dtype=long, device=device)
        self.tables[:, 0] = scratch_block
        self.lens = torch.ones(n, dtype=long, device=device)
        self.rows = torch.arange(n, dtype=long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # each graph's logits
        if capture:
            self._capture()

    def fits(self, chunks: list[ScheduledChunk]) -> bool:
        """Every chunk decodes one token (no drafts) and the batch fits a bucket."""
        return 0 < len(chunks) <= self.max_batch and all(
            c.num_new_tokens == 1 and not c.draft and c.samples for c in chunks)

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """The step's float32 logits [n, vocab], on the device (``fits(chunks)``)."""
        n = len(chunks)
        bucket = next(b for b in self.buckets if b >= n)
        bs, scratch = self.block_size, self.scratch_block
        # the widest table this step reads; columns past it keep older ids, never read
        width = max(-(-(c.start + 1) // bs) for c in chunks)
        ids, positions, slots, lens = [], [], [], []
        tables: list[int] = []
        for c in chunks:
            seq, pos = c.seq, c.start
            table = seq.block_table[:width]
            ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(seq.block_table[pos // bs] * bs + pos % bs)
            lens.append(pos + 1)
            tables.extend(table)
            tables.extend([0] * (width - len(table)))
        pad = bucket - n  # context 1, K/V into the scratch block
        ids += [0] * pad
        positions += [0] * pad
        slots += [scratch * bs] * pad
        lens += [1] * pad

        def fill(dst: torch.Tensor, values: list[int]) -> None:
            dst.copy_(torch.tensor(values, dtype=torch.long), non_blocking=True)

        fill(self.ids[:bucket], ids)
        fill(self.positions[:bucket], positions)
        fill(self.slots[:bucket], slots)
        fill(self.lens[:bucket], lens)
        self.tables[:n, :width].copy_(torch.tensor(tables, dtype=torch.long).view(n, width),
                                      non_blocking=True)
        if pad:
            self.tables[n:bucket, 0].fill_(scratch)
        if self.graphs:
            self.graphs[bucket].replay()
            return self.outputs[bucket][:n]
        return self._forward(bucket)[:n]

    def _batch(self, b: int) -> AttentionBatch:
        rows = self.rows[:b]
        group = DecodeGroup(num_seqs=b, token_range=(0, b), token_indices=None, tokens=rows,
                            block_ids=self.tables[:b].view(-1), blocks_per_seq=self.width,
                            context_lens=self.lens[:b])
        return AttentionBatch(num_tokens=b, block_size=self.block_size,
                              positions=self.positions[:b], slot_mapping=self.slots[:b],
                              last_token_indices=rows, decode=group)

    @torch.inference_mode()
    def _forward(self, b: int) -> torch.Tensor:
        hidden = self.model(self.ids[:b], self.positions[:b], self.kv_caches, self._batch(b))
        return self.model.compute_logits(hidden).float()

    def _capture(self) -> None:
        """One graph per bucket, largest first, in one memory pool; each warmed up once
        on a side stream (cuBLAS and Triton pick and load their kernels there)."""
        pool = None
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):
                self._forward(b)
        torch.cuda.current_stream().wait_stream(stream)
        for b in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._forward(b)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()
        log.info("CUDA graphs captured for decode batches %s", self.buckets)
