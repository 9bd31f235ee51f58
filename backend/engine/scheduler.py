"""Iteration-level scheduler (pure Python; no tensors).

Each step gets one token budget (``max_num_batched_tokens``) shared by decode tokens and
prefill chunks, and at most ``max_num_seqs`` sequences.

Urgency. A request's key is ``priority * aging_s + arrival_time``: lower is more urgent.
That is exactly "priority, minus one level for every ``aging_s`` seconds waited", and
because every request ages at the same rate the order never changes while they wait, so
nothing starves: a request of priority p is served no later than one of priority 0 that
arrived ``p * aging_s`` seconds after it.

One step, in order:
  0. If the most urgent waiting request is more urgent than some running ones and would
     fit if they left, preempt them (least urgent first).
  1. Running sequences, most urgent first, each get their next chunk (1 token when
     decoding). When blocks run out, the least urgent running sequence is preempted by
     recompute: its blocks go back to the pool with their hashes, so resuming is mostly
     a prefix-cache hit.
  2. Waiting sequences, most urgent first, are admitted while budget, sequence slots and
     blocks last. One that does not fit is skipped so smaller ones behind it still run;
     step 0 makes room for it as soon as preempting less urgent work would.

Several choices (``n`` > 1). A request is admitted as one sequence that holds ``n`` slots
of ``max_num_seqs`` (all of them, if ``n`` is larger) and prefills the prompt once; when
the prompt is computed the engine forks it (``fork``) into ``n`` sequences that share its
blocks, each reference-counted. From then on each choice is scheduled, preempted and
finished as a sequence of its own; the request lives (``group``) until its last choice
ends, and ``abort`` ends them all. Preemption is per sequence, which is correct because
nothing but ref counts ties the choices: a preempted choice drops its references (the
shared prompt blocks stay with its siblings, hashed), and its recompute finds them again
as a prefix-cache hit, so only its own tail is computed twice.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import MAX_PREFILL_CHUNKS, FinishReason, Sequence, SequenceStatus

# Speculative decoding backs off per sequence: when its smoothed acceptance (from 0.35,
# SPEC_SMOOTHING the weight of each step) falls below SPEC_MIN_ACCEPTANCE, it drafts
# nothing for a pause that doubles from SPEC_PAUSE_MIN steps up to SPEC_PAUSE_MAX while
# low acceptance lasts, and each pause ends with a one-token probe (accepted: full drafts
# again). A drafter that never agrees costs one failed step, then one-token probes after
# 8, 16, 32 and then every SPEC_PAUSE_MAX steps, not a K-token draft every step.
SPEC_MIN_ACCEPTANCE = 0.2
SPEC_SMOOTHING = 0.5  # weight of the latest step in the smoothed acceptance
SPEC_PAUSE_MIN = 8
SPEC_PAUSE_MAX = 64

# Admission looks this far past requests that do not fit, bounding a step's work when
# the queue is long and the KV cache is full.
MAX_SKIPPED_PER_STEP = 32


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first token position computed in this step
    num_new_tokens: int
    # speculative decoding (spec.py): slots and blocks reserved for this many drafts after
    # the decoded token, and the drafts the drafter filled in (at most num_spec)
    num_spec: int = 0
    draft: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's last known token (so it yields logits)."""
        return self.start + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # copy-on-write block copies (src, dst) to run before the model (BlockManager.ensure)
    copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        aging_s: float = 2.0,
        watermark: float = 0.01,
        clock: Callable[[], float] = time.monotonic,
        num_spec_tokens: int = 0,
        spec_max_batch: int = 0,
    ) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.aging_s = aging_s
        # New admissions leave this many blocks free for running sequences to grow into.
        self.watermark_blocks = int(watermark * block_manager.num_blocks)
        self.clock = clock
        # Speculative decoding: reserve this many draft slots for each speculating decode
        # while at most spec_max_batch sequences decode (0: never).
        self.num_spec_tokens = num_spec_tokens
        self.spec_max_batch = spec_max_batch
        self.waiting: list[Sequence] = []  # sorted by key
        self.running: list[Sequence] = []
        self._keys: dict[str, tuple[float, int]] = {}
        self._by_id: dict[str, list[Sequence]] = {}  # a request's live sequences
        self._counter = 0
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------
    def key(self, seq: Sequence) -> tuple[float, int]:
        return self._keys[seq.request_id]

    def add(self, seq: Sequence) -> None:
        """Queue a validated sequence (the engine checks lengths before)."""
        if seq.request_id in self._by_id:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        self._counter += 1
        self._keys[seq.request_id] = (seq.priority * self.aging_s + seq.arrival_time,
                                      self._counter)
        self._by_id[seq.request_id] = [seq]
        seq.status = SequenceStatus.WAITING
        self._insert_waiting(seq)

    def _insert_waiting(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=self.key)

    def get(self, request_id: str) -> Sequence | None:
        """A live sequence of the request (its lowest choice still running), or None."""
        group = self._by_id.get(request_id)
        return group[0] if group else None

    def group(self, request_id: str) -> list[Sequence]:
        """The request's live sequences (one per choice not finished yet)."""
        return list(self._by_id.get(request_id, ()))

    def fork(self, parent: Sequence) -> list[Sequence]:
        """Start choices 1..n-1 of a request whose prompt ``parent`` has just computed:
        running sequences with its tokens, sharing its blocks (copy on write)."""
        children = []
        for i in range(1, parent.params.n):
            child = Sequence(
                request_id=parent.request_id, prompt_token_ids=parent.prompt_token_ids,
                params=parent.params, priority=parent.priority,
                arrival_time=parent.arrival_time, cache_salt=parent.cache_salt, index=i,
                token_ids=list(parent.token_ids), status=SequenceStatus.RUNNING,
                num_cached_tokens=parent.num_cached_tokens,
                num_draft_computed_tokens=parent.num_draft_computed_tokens,
                num_preemptions=parent.num_preemptions,
                first_scheduled_time=parent.first_scheduled_time,
                prefill_chunks=list(parent.prefill_chunks))
            self.bm.fork(parent, child)
            children.append(child)
        self.running.extend(children)
        self._by_id[parent.request_id].extend(children)
        return children

    def _slots(self, seq: Sequence) -> int:
        return min(seq.num_slots, self.max_num_seqs)

    def _slots_used(self) -> int:
        return sum(self._slots(s) for s in self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence from any state and release its blocks. Idempotent."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
        # A request aborted before its prompt was fully computed leaves nothing cached.
        aborted_in_prefill = reason is FinishReason.ABORT and \
            seq.num_computed_tokens < seq.num_prompt_tokens
        self.bm.free(seq, uncache=aborted_in_prefill)
        seq.status = SequenceStatus.FINISHED
        if seq.finish_reason is None:
            seq.finish_reason = reason
        group = self._by_id.get(seq.request_id, [])
        if seq in group:
            group.remove(seq)
        if not group:  # the request's last choice
            self._keys.pop(seq.request_id, None)
            self._by_id.pop(seq.request_id, None)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish every choice of a request with reason abort; the first of them, or None
        (unknown or finished ids are a no-op)."""
        group = self.group(request_id)
        for seq in group:
            self.finish(seq, FinishReason.ABORT)
        return group[0] if group else None

    def preempt(self, seq: Sequence) -> None:
        """Drop a running sequence's KV (recompute later) and queue it again."""
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._insert_waiting(seq)

    # ---- one step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.running.sort(key=self.key)
        self._preempt_for_urgent_waiting(out)
        made_room = len(out.preempted)
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if len(out.preempted) == made_room:  # admitting while running ones starve would thrash
            self._schedule_waiting(out, budget)
        out.copies = self.bm.take_copies()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        spec = self._step_spec_tokens()
        later = self._later_block_needs(budget) if spec else []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if spec and seq.num_tokens - seq.num_computed_tokens == 1:
                num_spec = self._num_spec(seq, spec, budget)
                # Drafts take only blocks that neither the sequences after this one (their
                # next chunk) nor the admission watermark need: they never cause a
                # preemption. (Free blocks that still hold a cached prefix count: a full
                # cache is the steady state, and they go least recently used first.)
                spare = self.bm.num_free_blocks - later[i] - self.watermark_blocks
                if num_spec and self._blocks_to_grow(seq, seq.num_tokens + num_spec) <= spare \
                        and self.bm.ensure(seq, seq.num_tokens + num_spec):
                    out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, 1,
                                                     num_spec))
                    budget -= 1 + num_spec
                    i += 1
                    continue
            while not self.bm.ensure(seq, seq.num_computed_tokens + num_new):
                victim = self.running[-1]  # least urgent, not scheduled yet this step
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, num_new))
                budget -= num_new
                i += 1
        return budget

    def _blocks_to_grow(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``BlockManager.ensure(seq, num_tokens)`` takes: new ones, and copies of
        shared ones it writes into."""
        table = seq.block_table
        first = seq.num_computed_tokens // self.bm.block_size
        shared = sum(1 for b in table[first:] if self.bm.ref_counts[b] > 1)
        return max(self.bm.blocks_needed(num_tokens) - len(table), 0) + shared

    def _later_block_needs(self, budget: int) -> list[int]:
        """For each running sequence, the blocks the ones after it take for their next chunk
        (at most ``budget`` tokens each): what drafts must leave them."""
        needs = [self._blocks_to_grow(s, s.num_computed_tokens
                                      + min(s.num_tokens - s.num_computed_tokens, budget))
                 for s in self.running]
        out = [0] * len(needs)
        for i in range(len(needs) - 2, -1, -1):
            out[i] = out[i + 1] + needs[i + 1]
        return out

    def _step_spec_tokens(self) -> int:
        """Drafts each speculating sequence may get this step: none when the decoding
        batch is larger than ``spec_max_batch``."""
        if not self.num_spec_tokens:
            return 0
        decoding = sum(1 for s in self.running if s.num_tokens - s.num_computed_tokens == 1)
        return self.num_spec_tokens if decoding <= self.spec_max_batch else 0

    def _num_spec(self, seq: Sequence, spec: int, budget: int) -> int:
        """Drafts to reserve for a decoding sequence: within the budget, and never past
        its ``max_tokens`` or the context length (a step emits accepted + 1 tokens). Seeded
        sampled requests never speculate: how many drafts a step gets depends on the batch,
        and so would their draws, where a seed promises the same tokens in any batch.
        Constrained ones (a grammar) do not either: their masks are one per step."""
        p = seq.params
        if not p.speculative or p.penalized or (p.seed is not None and not p.greedy) \
                or p.grammar is not None \
                or seq.num_output_tokens == 0:  # its prompt's last chunk (before n forks)
            return 0
        if seq.spec_pause:
            seq.spec_pause -= 1
            seq.spec_probe = not seq.spec_pause
            return 0
        return max(0, min(1 if seq.spec_probe else spec, budget - 1,
                          p.max_tokens - seq.num_output_tokens - 1,
                          self.max_model_len - seq.num_tokens - 1))

    def accept(self, seq: Sequence, accepted: int, proposed: int) -> None:
        """After verification: the first ``accepted`` of ``proposed`` drafts of ``seq``
        (already in its tokens, with the target's own token after them) have their K/V
        computed; the blocks reserved for rejected positions go back to the pool; low
        acceptance pauses its drafting (``SPEC_MIN_ACCEPTANCE``)."""
        if seq.status is not SequenceStatus.RUNNING:
            return  # it finished on one of the tokens (its blocks are freed)
        if proposed:
            seq.spec_probe = False
            seq.spec_acceptance += SPEC_SMOOTHING * (accepted / proposed - seq.spec_acceptance)
            if seq.spec_acceptance < SPEC_MIN_ACCEPTANCE:
                seq.spec_backoff = min(max(2 * seq.spec_backoff, SPEC_PAUSE_MIN),
                                       SPEC_PAUSE_MAX)
                seq.spec_pause = seq.spec_backoff
                seq.spec_acceptance = SPEC_MIN_ACCEPTANCE  # one good probe resumes it
            else:
                seq.spec_backoff = 0
        seq.num_computed_tokens += accepted
        self.bm.commit(seq)
        self.bm.trim(seq, seq.num_tokens)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        admitted: list[Sequence] = []
        skipped = 0
        slots = self._slots_used()
        for seq in self.waiting:
            if budget <= 0 or slots >= self.max_num_seqs:
                break
            num_new = None
            if slots + self._slots(seq) <= self.max_num_seqs:
                num_new = self.try_admit(seq, budget, reserve=self.watermark_blocks)
            if num_new is None:
                skipped += 1  # does not fit now; smaller requests behind it may
                if skipped >= MAX_SKIPPED_PER_STEP:
                    break
                continue
            admitted.append(seq)
            slots += self._slots(seq)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, num_new))
            budget -= num_new
        for seq in admitted:
            self.waiting.remove(seq)
            self.running.append(seq)

    def try_admit(self, seq: Sequence, budget: int, reserve: int) -> int | None:
        """Give a waiting sequence the blocks for its next chunk of at most ``budget``
        tokens (prefix-cache hits first), leaving ``reserve`` blocks free, and mark it
        running; the chunk's size, or None if the blocks are not there. The caller moves
        it from ``waiting`` to ``running``."""
        cached = self.bm.lookup(seq)
        computed = len(cached) * self.bm.block_size
        num_new = min(seq.num_tokens - computed, budget)
        if not self.bm.allocate(seq, cached, computed + num_new, reserve=reserve):
            return None
        seq.status = SequenceStatus.RUNNING
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = self.clock()
            seq.num_cached_tokens = seq.num_computed_tokens
        return num_new

    def _preempt_for_urgent_waiting(self, out: SchedulerOutput) -> None:
        if not self.waiting or not self.running:
            return
        head = self.waiting[0]
        head_key = self.key(head)
        victims = [s for s in self.running if self.key(s) > head_key]
        if not victims:
            return
        slots_short = self._slots_used() + self._slots(head) > self.max_num_seqs
        first_chunk = min(head.num_tokens, self.max_num_batched_tokens)
        need = self.bm.blocks_needed(first_chunk) + self.watermark_blocks
        if not slots_short and need <= self.bm.num_free_blocks:
            return  # it fits without preempting anyone
        # Only preempt if that actually makes it fit (otherwise we would thrash).
        reclaimable = sum(1 for s in victims for b in s.block_table if self.bm.ref_counts[b] == 1)
        if need > self.bm.num_free_blocks + reclaimable:
            return
        for victim in reversed(victims):  # least urgent first
            self.preempt(victim)
            out.preempted.append(victim)
            if need <= self.bm.num_free_blocks \
                    and self._slots_used() + self._slots(head) <= self.max_num_seqs:
                break

    # ---- after the model ran ------------------------------------------------------------
    def on_step_done(self, out: SchedulerOutput, started: float | None = None,
                     ended: float | None = None) -> None:
        """Advance computed-token counts and register newly full blocks in the cache.

        With the step's times, each prefill chunk (any chunk before the first token, and
        multi-token recompute chunks after a preemption) is noted on its sequence."""
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            n = chunk.num_new_tokens
            if (n > 1 or seq.first_token_time is None) and started is not None \
                    and len(seq.prefill_chunks) < MAX_PREFILL_CHUNKS:
                seq.prefill_chunks.append((chunk.start, n, started,
                                           started if ended is None else ended))
            seq.num_computed_tokens = chunk.start + n
            self.bm.commit(seq)

    def check_length(self, seq: Sequence) -> FinishReason | None:
        if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None
