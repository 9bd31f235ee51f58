"""Turns a scheduled step into tensors, runs the model, returns logits.

Together with ``models/`` and ``attention.py`` this is the only code that touches tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .attention import build_attention_batch
from .sampler import torch_argmax
from .scheduler import ScheduledChunk

if TYPE_CHECKING:
    from .cuda_graphs import DecodeGraphs
    from .models import CausalLM


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        # decode steps replayed from CUDA graphs where they fit (cuda_graphs.py)
        self.graphs: DecodeGraphs | None = None

    def argmax(self, logits: torch.Tensor) -> list[int]:
        """Greedy picks for ``execute``'s logits: the model's native argmax where it has one
        (``FusedDecoder.argmax``), else torch's."""
        fused = self.model.fused
        return fused.argmax(logits) if fused is not None else torch_argmax(logits)

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks, ``(src, dst)`` pairs in order, in every layer (copy on
        write of a forked sequence's last block, ``BlockManager.ensure``)."""
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.device)
        for k, v in self.kv_caches:  # [kv_heads, num_blocks, block_size, head_dim]
            k.index_copy_(1, dst, k.index_select(1, src))
            v.index_copy_(1, dst, v.index_select(1, src))

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Run one step; return float32 logits for the chunks that sample, in order, on the
        model's device (the engine copies them to the host only for what needs them
        there: ``LLMEngine.step``).

        A chunk with drafts (``chunk.draft``, speculative decoding) runs as 1 + m decode
        rows of its block table, one per position, and gives m + 1 rows of logits (every
        row's K/V is written before any row attends, so row j sees the drafts before it).
        A step of decodes only runs from a CUDA graph where ``graphs`` has one for it.
        """
        if self.graphs is not None and self.graphs.fits(chunks):
            return self.graphs.run(chunks)
        logits = self._execute(chunks)
        if self.device.type == "cuda" and any(c.num_new_tokens > 1 for c in chunks):
            # the engine stamps the step's end after this: a prefill's times (traces,
            # TTFT) end when the GPU is done, not when its kernels were queued
            torch.cuda.synchronize(self.device)
        return logits

    def _execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        input_ids: list[int] = []
        specs: list[tuple[list[int], int, int]] = []
        sampling: list[int] = []  # indexes into specs
        for chunk in chunks:
            seq, start, n = chunk.seq, chunk.start, chunk.num_new_tokens
            if chunk.draft:
                for j, tok in enumerate([seq.token_ids[start], *chunk.draft]):
                    input_ids.append(tok)
                    sampling.append(len(specs))
                    specs.append((seq.block_table, start + j, 1))
                continue
            input_ids.extend(seq.token_ids[start:start + n])
            if chunk.samples:
                sampling.append(len(specs))
            specs.append((seq.block_table, start, n))
        return self.run(input_ids, specs, sampling, host=False)

    @torch.inference_mode()
    def run(self, input_ids: list[int], specs: list[tuple[list[int], int, int]],
            sampling: list[int], host: bool = True) -> torch.Tensor:
        """One forward over ``specs`` ((block table, computed, new) per sequence, their
        new tokens ``input_ids`` flat in that order); float32 logits of the last new token
        of each spec listed in ``sampling``, on the CPU (``host``) or the model's device.
        Nothing in it reads a tensor back to the host but that final copy."""
        dev = self.device
        batch = build_attention_batch(specs, self.block_size, dev)
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=dev)
        hidden = self.model(ids_t, batch.positions, self.kv_caches, batch)
        if not sampling:
            return torch.empty(0, 0)
        last = batch.last_token_indices
        if len(sampling) < len(specs):  # chunks mid-prefill yield no logits
            rows = torch.tensor(sampling, dtype=torch.long).to(dev, non_blocking=True)
            last = last.index_select(0, rows)
        logits = self.model.compute_logits(hidden.index_select(0, last)).float()
        return logits.cpu() if host else logits
