"""The static-batching baseline: request-level batching (HF ``generate``,
FasterTransformer) on the production engine, built here out of its public parts.

A batch is formed only when none is running, and runs to completion: its rows are padded
to the longest prompt, and a row that finishes keeps computing as padding until the
longest row ends, as in a padded tensor batch. The engine never sees the padding: the
``StaticBatchScheduler`` keeps padding rows out of ``running`` (so they are never sampled
for a caller, never counted in ``state()``) and ``PaddedRunner`` runs them in the same
forward pass as the batch's real rows, so they cost what they cost in a padded batch.

    LLMEngine ─ runner ───▶ PaddedRunner ─ execute(real + padding) ─▶ ModelRunner
        │                         │  this step's padding chunks in, their picks out
        └─ scheduler ─▶ StaticBatchScheduler (schedule, finish, on_step_done)

Rows take the step's token budget in the batch's order, a finished row's padding in its
place, as the padded tensor batch lays them out. When the KV blocks run out so that no
real row can grow, the padding rows are freed (a padded tensor batch has no such limit, and
the engine runs no step that computes for nobody).

Padding rows:
- prompt padding: a throwaway row of ``longest - len(prompt)`` tokens per shorter prompt,
  freed once its prefill is computed;
- finished rows: a real row that ends while its batch runs hands its blocks and tokens to a
  padding row that keeps decoding (its request id is free at once: an abort is a no-op),
  until the batch ends or the row reaches ``max_model_len``.
The batch ends, and every padding row is freed, when its last real row leaves.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch

from backend.engine.block_manager import BlockManager
from backend.engine.builder import EngineParts
from backend.engine.engine import LLMEngine, Runner
from backend.engine.sampler import Argmax, torch_argmax
from backend.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from backend.engine.sequence import FinishReason, Sequence, SequenceStatus


class StaticBatchScheduler(Scheduler):
    """Form a batch when none runs; run it, padding included, to completion."""

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(block_manager, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len=max_model_len, clock=clock)
        # The batch's rows in tensor order: real rows as admitted, a finished one replaced
        # in place by the padding row that takes it over, prompt padding rows last.
        self.batch: list[Sequence] = []
        self._padding: set[Sequence] = set()  # rows that compute for no caller
        self._prompt_padding: set[Sequence] = set()
        self.padding_chunks: list[ScheduledChunk] = []  # this step's, for PaddedRunner
        self._picks: list[int] = []  # PaddedRunner's greedy picks for the sampling ones

    @classmethod
    def like(cls, scheduler: Scheduler) -> StaticBatchScheduler:
        """A static scheduler with ``scheduler``'s block manager, limits and clock."""
        return cls(scheduler.bm, max_num_seqs=scheduler.max_num_seqs,
                   max_num_batched_tokens=scheduler.max_num_batched_tokens,
                   max_model_len=scheduler.max_model_len, clock=scheduler.clock)

    @property
    def padding(self) -> list[Sequence]:
        return [row for row in self.batch if row in self._padding]

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if not self.running:
            self._form_batch()
        while True:
            out, self.padding_chunks = SchedulerOutput(), []
            budget = self.max_num_batched_tokens  # one budget, rows in the batch's order
            for row in self.batch:
                if budget <= 0:
                    break
                num_new = min(row.num_tokens - row.num_computed_tokens, budget)
                if num_new <= 0:
                    continue
                if not self.bm.ensure(row, row.num_computed_tokens + num_new):
                    continue  # out of blocks: this row idles this step
                chunk = ScheduledChunk(row, row.num_computed_tokens, num_new)
                (self.padding_chunks if row in self._padding else out.chunks).append(chunk)
                budget -= num_new
            if out.chunks or not self._padding:
                return out
            # No real row could grow: the engine runs no step without one, so the padding
            # gives way (a padded tensor batch never runs out of blocks).
            for row in self.padding:
                self._drop(row)

    def _form_batch(self) -> None:
        batch: list[Sequence] = []
        for seq in list(self.waiting):
            if len(batch) >= self.max_num_seqs:
                break
            if self.try_admit(seq, seq.num_tokens, reserve=0) is None:
                break
            batch.append(seq)
            self.waiting.remove(seq)
            self.running.append(seq)
        self.batch = list(batch)
        if not batch:
            return
        # Pad every prompt to the longest, as a padded tensor batch would: a throwaway row
        # computes the missing positions.
        longest = max(s.num_tokens for s in batch)
        for seq in batch:
            pad = longest - seq.num_tokens
            if pad <= 0:
                continue
            row = Sequence(request_id=f"{seq.request_id}#pad", prompt_token_ids=[0] * pad,
                           params=seq.params, arrival_time=seq.arrival_time)
            if not self.bm.allocate(row, [], pad):
                continue  # no room to pad: the baseline gets that much cheaper
            row.status = SequenceStatus.RUNNING
            self.batch.append(row)
            self._padding.add(row)
            self._prompt_padding.add(row)

    def padding_sampled(self, picks: list[int]) -> None:
        """``PaddedRunner``: the picks of this step's sampling padding chunks, in order."""
        self._picks = picks

    def on_step_done(self, out: SchedulerOutput, started: float | None = None,
                     ended: float | None = None) -> None:
        super().on_step_done(out, started, ended)
        chunks, self.padding_chunks = self.padding_chunks, []
        sampled = [c.seq for c in chunks if c.samples]  # before any token is appended
        super().on_step_done(SchedulerOutput(chunks))  # computed counts, cache commits
        for row, tok in zip(sampled, self._picks, strict=True):
            if row in self._prompt_padding:  # its prefill is all it is for
                self._drop(row)
                continue
            row.token_ids.append(tok)
            if row.num_tokens >= self.max_model_len:
                self._drop(row)
        self._picks = []

    # ---- a row that ends ----------------------------------------------------------------
    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        in_batch = seq in self.batch
        if in_batch and reason is not FinishReason.ABORT \
                and any(s is not seq for s in self.running):
            row = self._take_over(seq)  # it keeps computing as padding, in its place
            self.batch[self.batch.index(seq)] = row
            self._padding.add(row)
        elif in_batch:
            self.batch.remove(seq)
        super().finish(seq, reason)
        if not self.running:  # the batch has ended
            for row in self.padding:
                self._drop(row)

    def _take_over(self, seq: Sequence) -> Sequence:
        """A padding row holding ``seq``'s tokens and blocks; ``seq`` is left with none."""
        row = Sequence(request_id=f"{seq.request_id}#done",
                       prompt_token_ids=seq.prompt_token_ids, params=seq.params,
                       token_ids=list(seq.token_ids),
                       cache_salt=seq.cache_salt, status=SequenceStatus.RUNNING,
                       block_table=seq.block_table, block_hashes=seq.block_hashes,
                       num_computed_tokens=seq.num_computed_tokens,
                       num_committed_blocks=seq.num_committed_blocks)
        seq.block_table, seq.block_hashes = [], []
        return row

    def _drop(self, row: Sequence) -> None:
        self.batch.remove(row)
        self._padding.discard(row)
        self._prompt_padding.discard(row)
        self.bm.free(row)
        row.status = SequenceStatus.FINISHED


class PaddedRunner:
    """A ``Runner`` that runs the scheduler's padding chunks with each step's real ones and
    returns the real ones' logits only (in order, as the engine expects)."""

    def __init__(self, inner: Runner, scheduler: StaticBatchScheduler) -> None:
        self.inner = inner
        self.scheduler = scheduler
        inner_argmax: Argmax | None = getattr(inner, "argmax", None)
        self.argmax: Argmax = inner_argmax or torch_argmax

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.inner.copy_blocks(copies)

    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        padding = self.scheduler.padding_chunks
        if not padding:
            return self.inner.execute(chunks)
        logits = self.inner.execute(chunks + padding)
        real = sum(1 for c in chunks if c.samples)
        if logits.shape[0] > real:
            self.scheduler.padding_sampled(self.argmax(logits[real:]))
        return logits[:real] if real else torch.empty(0, 0)


def with_static_batching(parts: EngineParts) -> EngineParts:
    """The same engine (model, KV cache, limits, tokenizer) with static batching. Build it
    before the engine runs anything: the two share the block manager."""
    core = parts.core
    scheduler = StaticBatchScheduler.like(core.scheduler)
    runner = PaddedRunner(parts.runner, scheduler)
    static = LLMEngine(runner=runner, scheduler=scheduler, vocab_size=core.vocab_size,
                       eos_token_ids=tuple(core.eos_token_ids),
                       make_detokenizer=core.make_detokenizer, make_salt=core.make_salt,
                       seed=core.seed, step_hook=core.step_hook)
    return replace(parts, core=static)
