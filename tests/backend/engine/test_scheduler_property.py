"""Property-based test of the scheduler and block manager, without a model.

A shadow KV cache records, for every slot the "model" writes, which salt and which token
prefix produced it. Before each chunk is "computed", every position it attends to must hold
exactly the K/V its own sequence would have produced: that checks paging, prefix-cache hits,
preemption, reuse of freed blocks and forked choices (``n`` > 1: shared blocks, copy on
write, each choice with tokens of its own) together.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend.engine.block_manager import BlockManager
from backend.engine.sampling import SamplingParams
from backend.engine.scheduler import Scheduler
from backend.engine.sequence import FinishReason, Sequence, SequenceStatus

BLOCK = 4
SALTS = [b"tenant-a", b"tenant-b"]


class Harness:
    def __init__(self, num_blocks: int, max_seqs: int, budget: int, prefix_cache: bool):
        self.bm = BlockManager(num_blocks, BLOCK, enable_prefix_cache=prefix_cache)
        self.now = 0.0
        self.sch = Scheduler(self.bm, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                             max_model_len=num_blocks * BLOCK, aging_s=1.0,
                             clock=lambda: self.now)
        self.shadow: dict[tuple[int, int], tuple[bytes, tuple[int, ...]]] = {}
        self.live: dict[str, Sequence] = {}
        self.n = 0

    def add(self, prompt: list[int], max_tokens: int, salt: int, priority: int,
            n: int = 1) -> None:
        max_tokens = max(1, min(max_tokens, self.sch.max_model_len - len(prompt)))
        if len(prompt) + max_tokens > self.sch.max_model_len:
            return
        self.n += 1
        params = SamplingParams(max_tokens=max_tokens, n=min(n, self.sch.max_num_seqs))
        seq = Sequence(f"r{self.n}", prompt, params,
                       priority=priority, arrival_time=self.now, cache_salt=SALTS[salt])
        self.sch.add(seq)
        self.live[seq.request_id] = seq

    def step(self, next_token: int) -> None:
        self.now += 0.1
        out = self.sch.schedule()
        for src, dst in out.copies:  # copy on write, before the model writes
            for off in range(BLOCK):
                if (src, off) in self.shadow:
                    self.shadow[(dst, off)] = self.shadow[(src, off)]
        for chunk in out.chunks:
            seq = chunk.seq
            assert seq.status is SequenceStatus.RUNNING
            assert chunk.start == seq.num_computed_tokens
            assert chunk.num_new_tokens >= 1
            assert chunk.start + chunk.num_new_tokens <= seq.num_tokens
            assert len(seq.block_table) * BLOCK >= chunk.start + chunk.num_new_tokens
            # Everything it attends to was written by an identical prefix.
            for pos in range(chunk.start):
                slot = (seq.block_table[pos // BLOCK], pos % BLOCK)
                assert self.shadow.get(slot) == (seq.cache_salt, tuple(seq.token_ids[:pos + 1])), \
                    f"{seq.request_id} reads stale KV at position {pos}"
            for pos in range(chunk.start, chunk.start + chunk.num_new_tokens):
                slot = (seq.block_table[pos // BLOCK], pos % BLOCK)
                self.shadow[slot] = (seq.cache_salt, tuple(seq.token_ids[:pos + 1]))
        assert out.num_batched_tokens <= self.sch.max_num_batched_tokens
        assert len(self.sch.running) <= self.sch.max_num_seqs
        self.sch.on_step_done(out)
        sampled = [c.seq for c in out.chunks if c.samples]
        for seq in list(sampled):
            if seq.awaits_fork:
                sampled += self.sch.fork(seq)
        for seq in sampled:
            seq.token_ids.append((next_token + seq.index) % 3)  # choices differ
            reason = self.sch.check_length(seq)
            if reason is not None:
                self.finish(seq, reason)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.sch.finish(seq, reason)
        if not self.sch.group(seq.request_id):
            self.live.pop(seq.request_id, None)

    def abort(self, index: int) -> None:
        if self.live:
            rid = sorted(self.live)[index % len(self.live)]
            self.sch.abort(rid)
            self.live.pop(rid)
        self.sch.abort("never-existed")  # no-op

    def finish_early(self, index: int) -> None:
        """A running request stops (EOS, stop string) before its max_tokens."""
        running = [s for s in self.sch.running if s.request_id in self.live]
        if running:
            self.finish(running[index % len(running)], FinishReason.STOP)

    def preempt(self, index: int) -> None:
        if self.sch.running:
            self.sch.preempt(self.sch.running[index % len(self.sch.running)])

    def check(self) -> None:
        self.bm.check_invariants()
        refs = [0] * self.bm.num_blocks
        holders: dict[int, set[bytes]] = {}
        for seq in (s for rid in self.live for s in self.sch.group(rid)):
            if seq.status is SequenceStatus.WAITING:
                assert not seq.block_table and seq.num_computed_tokens == 0
            for b in seq.block_table:
                refs[b] += 1
                holders.setdefault(b, set()).add(seq.cache_salt)
        assert refs == self.bm.ref_counts, "ref counts disagree with block tables"
        for b, salts in holders.items():
            assert len(salts) == 1, f"block {b} shared by two salts"
        assert all(r >= 0 for r in self.bm.ref_counts)


prompt_st = st.lists(st.integers(0, 2), min_size=1, max_size=24)
op_st = st.one_of(
    st.tuples(st.just("add"), prompt_st, st.integers(1, 12), st.integers(0, 1),
              st.integers(-2, 2), st.sampled_from([1, 1, 2, 3])),
    st.tuples(st.just("step"), st.integers(0, 2)),
    st.tuples(st.just("step"), st.integers(0, 2)),
    st.tuples(st.just("step"), st.integers(0, 2)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("finish"), st.integers(0, 50)),
    st.tuples(st.just("preempt"), st.integers(0, 50)),
)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op_st, min_size=1, max_size=80),
    num_blocks=st.integers(8, 24),
    max_seqs=st.integers(1, 6),
    budget=st.integers(1, 16),
    prefix_cache=st.booleans(),
)
def test_random_event_streams_keep_blocks_consistent(ops, num_blocks, max_seqs, budget,
                                                     prefix_cache):
    h = Harness(num_blocks, max_seqs, budget, prefix_cache)
    for op in ops:
        kind = op[0]
        if kind == "add":
            h.add(op[1], op[2], op[3], op[4], op[5])
        elif kind == "step":
            h.step(op[1])
        elif kind == "abort":
            h.abort(op[1])
        elif kind == "finish":
            h.finish_early(op[1])
        else:
            h.preempt(op[1])
        h.check()
    # Drain: everything eventually finishes (no request is stuck forever) ...
    for _ in range(2000):
        if not h.sch.has_work():
            break
        h.step(1)
        h.check()
    assert not h.sch.has_work(), "requests left that never finish"
    assert not h.live
    # ... and every block is back in the free pools.
    assert h.bm.num_free_blocks == num_blocks
    assert all(r == 0 for r in h.bm.ref_counts)
    h.bm.check_invariants()


def test_prefix_hit_never_covers_last_token_and_salts_isolate():
    bm = BlockManager(16, BLOCK)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    a = Sequence("a", list(range(8)), SamplingParams(max_tokens=2), cache_salt=b"x")
    sch.add(a)
    out = sch.schedule()
    sch.on_step_done(out)
    sch.finish(a, FinishReason.STOP)
    assert bm.num_cached_free_blocks == 2
    # Same 8 tokens again: only the first block may be reused (the last token is computed).
    b = Sequence("b", list(range(8)), SamplingParams(max_tokens=2), cache_salt=b"x")
    sch.add(b)
    out = sch.schedule()
    assert out.chunks[0].start == 4 and b.num_cached_tokens == 4
    # Another salt shares nothing.
    c = Sequence("c", list(range(8)), SamplingParams(max_tokens=2), cache_salt=b"y")
    sch.add(c)
    out = sch.schedule()
    assert [ch.start for ch in out.chunks if ch.seq is c] == [0]
    assert not set(c.block_table) & set(b.block_table)


def test_abort_mid_prefill_caches_nothing():
    bm = BlockManager(16, BLOCK)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64)
    a = Sequence("a", list(range(20)), SamplingParams(max_tokens=2))
    sch.add(a)
    sch.on_step_done(sch.schedule())  # 8 of 20 prompt tokens computed: two full blocks
    assert a.num_computed_tokens == 8
    sch.abort("a")
    assert bm.num_cached_free_blocks == 0 and bm.num_free_blocks == 16
    b = Sequence("b", list(range(20)), SamplingParams(max_tokens=2))
    sch.add(b)
    sch.schedule()
    assert b.num_cached_tokens == 0


def test_preempted_request_resumes_from_prefix_cache():
    bm = BlockManager(8, BLOCK)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32)
    a = Sequence("a", list(range(13)), SamplingParams(max_tokens=4), arrival_time=0.0)
    sch.add(a)
    sch.on_step_done(sch.schedule())
    sch.preempt(a)
    assert a.status is SequenceStatus.WAITING and not a.block_table
    out = sch.schedule()
    assert out.chunks[0].start == 12  # three full blocks come back from the cache
    assert sch.num_preemptions == 1


def test_big_request_does_not_block_smaller_ones_and_is_not_starved():
    bm = BlockManager(10, BLOCK)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=40,
                    watermark=0.0)
    small0 = Sequence("s0", [1] * 20, SamplingParams(max_tokens=4), arrival_time=0.0)
    big = Sequence("big", [2] * 28, SamplingParams(max_tokens=4), arrival_time=1.0)
    small1 = Sequence("s1", [3] * 16, SamplingParams(max_tokens=4), arrival_time=2.0)
    for s in (small0, big, small1):
        sch.add(s)
    out = sch.schedule()
    assert {c.seq.request_id for c in out.chunks} == {"s0", "s1"}  # big waits, s1 runs
    sch.on_step_done(out)
    sch.finish(small0, FinishReason.STOP)
    # big (7 blocks) is more urgent than s1 and fits once s1 leaves: s1 is preempted.
    out = sch.schedule()
    assert [c.seq.request_id for c in out.chunks] == ["big"]
    assert out.preempted == [small1] and small1.status is SequenceStatus.WAITING
    sch.on_step_done(out)
    sch.finish(big, FinishReason.STOP)
    out = sch.schedule()
    assert [c.seq.request_id for c in out.chunks] == ["s1"]
    assert out.chunks[0].start == 12  # its computed blocks came back from the cache


def test_priority_orders_admission_and_aging_bounds_wait():
    bm = BlockManager(64, BLOCK)
    sch = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64,
                    aging_s=1.0)
    low = Sequence("low", [1, 2], SamplingParams(max_tokens=1), priority=5, arrival_time=0.0)
    urgent = Sequence("urgent", [1, 2], SamplingParams(max_tokens=1), priority=0,
                      arrival_time=1.0)
    late = Sequence("late", [1, 2], SamplingParams(max_tokens=1), priority=0,
                    arrival_time=10.0)
    for s in (low, urgent, late):
        sch.add(s)
    order = []
    while sch.has_work():
        out = sch.schedule()
        sch.on_step_done(out)
        for c in out.chunks:
            order.append(c.seq.request_id)
            sch.finish(c.seq, FinishReason.LENGTH)
    # urgent beats low; low (5 levels x 1 s after t=0 -> key 5) beats "late" (key 10).
    assert order == ["urgent", "low", "late"]
