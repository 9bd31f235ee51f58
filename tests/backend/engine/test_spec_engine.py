"""Speculative decoding in the engine with the real tiny model: greedy output is exactly
the output without it, under concurrency, preemption, the prefix cache, n > 1 and aborts,
with both drafters; no KV block is left behind; opt-out and the batch threshold hold."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from backend.engine.builder import EngineParts, build_engine
from backend.engine.config import EngineConfig, SpecConfig
from backend.engine.errors import InvalidRequestError
from backend.engine.sampling import SamplingParams
from backend.engine.spec import lookup
from modelfiles.tiny_model import SIZES, write_tiny_model


def make(cache: Path, **kw) -> EngineParts:
    base = {"model": "tiny", "cache_dir": str(cache), "device": "cpu", "dtype": "float32",
            "block_size": 4, "kv_blocks": 256, "max_num_seqs": 16,
            "max_num_batched_tokens": 64}
    base.update(kw)
    return build_engine(EngineConfig(**base))


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("draft"), SIZES["tiny-draft"])


def workload(seed: int, n: int = 12, greedy: bool = True):
    """Repetitive prompts (the n-gram drafter finds its matches) and random ones."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        if i % 2:
            motif = [rng.randrange(3, 1000) for _ in range(rng.randint(2, 6))]
            prompt = (motif * 20)[:rng.randint(8, 60)]
        else:
            prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(3, 50))]
        params = SamplingParams(max_tokens=rng.randint(4, 40), ignore_eos=True,
                                temperature=0.0 if greedy else 0.8,
                                seed=None if greedy else 100 + i)
        reqs.append((f"r{i}", prompt, params))
    return reqs


def run(parts: EngineParts, reqs, *, stagger: int = 3, abort: set[str] = frozenset()):
    """Add the requests a few per step (later ones join running batches), abort some
    after their first tokens; the tokens of each and the final deltas."""
    core = parts.core
    out: dict[str, list[int]] = {}
    finals = {}
    pending = list(reqs)
    for _ in range(5000):
        for rid, prompt, params in pending[:stagger]:
            core.add_request(rid, prompt, params)
            out[rid] = []
        pending = pending[stagger:]
        if not core.has_work() and not pending:
            break
        for d in core.step():
            out[d.request_id].extend(d.token_ids)
            assert len(d.token_ids) == len(d.token_times)
            if d.finished:
                finals[d.request_id] = d
        bm = core.block_manager
        for seq in core.scheduler.running:  # blocks reserved for rejected drafts went back
            assert len(seq.block_table) <= bm.blocks_needed(seq.num_tokens)
            assert seq.num_draft_computed_tokens <= seq.num_tokens
        for rid in abort:
            if out.get(rid) and rid not in finals:
                delta = core.abort(rid)
                if delta is not None:
                    finals[rid] = delta
    assert set(finals) == set(out)
    bm = core.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks, "a KV block leaked"
    return out, finals


@pytest.fixture(scope="module")
def reference(tiny_cache_dir: Path):
    reqs = workload(1)
    out, _ = run(make(tiny_cache_dir), reqs)
    return reqs, out


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_output_is_identical_with_speculation(tiny_cache_dir, draft_dir, reference,
                                                     method):
    reqs, expected = reference
    spec = "ngram" if method == "ngram" else f"draft:{draft_dir}"
    parts = make(tiny_cache_dir, speculative=spec, num_speculative_tokens=3,
                 speculative_max_batch=16)
    got, finals = run(parts, reqs)
    assert got == expected
    st = parts.core.state()
    assert st.spec_proposed_tokens > 0 and st.spec_accepted_tokens > 0
    assert st.spec_verify_steps > 0 and st.spec_tokens_per_step > 1.0
    # several tokens in one delta: the accepted drafts arrive together
    assert all(len(f.token_ids) <= 4 for f in finals.values())


def test_speculation_survives_preemption_and_aborts(tiny_cache_dir, draft_dir, reference):
    reqs, expected = reference
    parts = make(tiny_cache_dir, speculative=f"draft:{draft_dir}", num_speculative_tokens=4,
                 speculative_max_batch=16, kv_blocks=40)  # 160 slots for ~12 requests
    aborted = {"r3", "r6"}
    got, finals = run(parts, reqs, stagger=12, abort=aborted)
    st = parts.core.state()
    assert st.preemptions > 0 and st.spec_accepted_tokens > 0
    for rid, toks in got.items():
        if rid in aborted:
            assert finals[rid].finish_reason == "abort"
            assert toks == expected[rid][:len(toks)]
        else:
            assert toks == expected[rid]


def test_prefix_cache_hits_and_n_choices_with_speculation(tiny_cache_dir):
    motif = [11, 12, 13, 14, 15]
    system = motif * 8
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reqs = [(f"p{i}", system + [20 + i], params) for i in range(4)]
    plain, _ = run(make(tiny_cache_dir), reqs, stagger=1)
    parts = make(tiny_cache_dir, speculative="ngram", speculative_max_batch=16)
    got, _ = run(parts, reqs, stagger=1)
    st = parts.core.state()
    assert got == plain and st.prefix_cache_hits >= 3 and st.spec_accepted_tokens > 0
    # n = 3 seeded choices: the same tokens as three requests would not be (one draw per
    # token changes), but every choice ends at its length and nothing leaks
    many = SamplingParams(max_tokens=12, temperature=0.7, n=3, seed=5, ignore_eos=True)
    got, finals = run(parts, [("n3", system, many)])
    assert len(got["n3"]) == 36 and finals["n3"].finished


def test_seeded_sampling_stays_batch_independent_and_unseeded_speculates(tiny_cache_dir):
    reqs = workload(4, n=6, greedy=False)
    plain, _ = run(make(tiny_cache_dir), reqs, stagger=1)
    parts = make(tiny_cache_dir, speculative="ngram", speculative_max_batch=16)
    got, _ = run(parts, reqs, stagger=6)
    assert got == plain  # seeded requests do not speculate: the same draws in any batch
    assert parts.core.state().spec_proposed_tokens == 0
    unseeded = [(rid, prompt, SamplingParams(max_tokens=p.max_tokens, temperature=0.8,
                                             ignore_eos=True)) for rid, prompt, p in reqs]
    got, _ = run(parts, unseeded, stagger=6)
    assert all(len(got[rid]) == p.max_tokens for rid, _, p in unseeded)
    assert parts.core.state().spec_proposed_tokens > 0


def test_opt_out_and_the_batch_threshold(tiny_cache_dir):
    motif = [7, 8, 9] * 10
    off = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, speculative=False)
    parts = make(tiny_cache_dir, speculative="ngram")
    run(parts, [("off", motif, off)])
    assert parts.core.state().spec_proposed_tokens == 0
    on = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    # two decoding sequences over a threshold of one: no step speculates
    parts = make(tiny_cache_dir, speculative="ngram", speculative_max_batch=1)
    run(parts, [("a", motif, on), ("b", motif[1:], on)], stagger=2)
    assert parts.core.state().spec_proposed_tokens == 0
    run(parts, [("c", motif, on)])
    assert parts.core.state().spec_proposed_tokens > 0
    # penalised requests never speculate (their logits depend on every earlier token)
    parts = make(tiny_cache_dir, speculative="ngram")
    run(parts, [("pen", motif, SamplingParams(max_tokens=20, temperature=0.0,
                                               ignore_eos=True, presence_penalty=0.5))])
    assert parts.core.state().spec_proposed_tokens == 0


def test_the_version_names_the_speculative_config(tiny_cache_dir, draft_dir):
    plain = make(tiny_cache_dir).versions.versions.engine
    ngram = make(tiny_cache_dir, speculative="ngram").versions.versions.engine
    draft = make(tiny_cache_dir, speculative=f"draft:{draft_dir}",
                 num_speculative_tokens=2).versions.versions.engine
    assert "+spec" not in plain
    assert ngram == plain + "+spec-ngram-k4-b8"
    assert draft.startswith(plain + "+spec-draft.") and draft.endswith("-k2-b8")


@pytest.mark.parametrize("kw", [
    {"speculative": "eagle"}, {"speculative": "draft"}, {"speculative": "ngram:x"},
    {"speculative": "ngram", "num_speculative_tokens": 0},
    {"speculative": "ngram", "num_speculative_tokens": 17},
    {"speculative": "ngram", "speculative_max_batch": 0},
])
def test_bad_speculative_settings_are_refused(kw):
    with pytest.raises(InvalidRequestError):
        EngineConfig(**kw)


def test_a_draft_with_another_vocabulary_is_refused(tiny_cache_dir, tmp_path):
    import torch

    from backend.bench.checkpoint import TEST_MODEL, write_checkpoint
    other = write_checkpoint(tmp_path / "other", TEST_MODEL, torch.float32)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        make(tiny_cache_dir, speculative=f"draft:{other}")


def test_spec_config_parse_and_describe():
    c = SpecConfig.parse("draft:/m/d", 3, 4)
    assert (c.method, c.draft_model, c.num_tokens, c.max_batch) == ("draft", "/m/d", 3, 4)
    assert c.describe("ab" * 20) == "spec-draft.abababababab-k3-b4"


@pytest.mark.parametrize("tokens,k,expected", [
    ([1, 2, 3, 4, 1, 2], 3, [3, 4, 1]),  # the longest suffix (1, 2) matched
    ([5, 1, 2, 3, 9, 9, 1, 2], 2, [3, 9]),
    ([1, 2, 3, 1, 2, 4, 1, 2], 1, [4]),  # the latest occurrence wins
    ([1, 2, 3], 2, []),  # no earlier occurrence
    ([256, 1, 256], 2, [1, 256]),  # bytes of 256 are not mistaken for other ids
    ([1, 256 * 256 + 1, 1], 1, [256 * 256 + 1]),
    ([3, 3], 0, []),
    ([7, 7, 7, 7], 3, [7, 7, 7]),  # a loop shorter than k continues periodically
    ([1, 2, 3, 1, 2], 4, [3, 1, 2, 3]),
])
def test_ngram_lookup(tokens, k, expected):
    assert lookup(tokens, k) == expected


def test_drafts_never_take_the_blocks_other_sequences_need():
    from backend.engine.block_manager import BlockManager
    from backend.engine.scheduler import Scheduler
    from backend.engine.sequence import Sequence

    bm = BlockManager(5, 4)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                    watermark=0, num_spec_tokens=4, spec_max_batch=4)
    params = SamplingParams(max_tokens=20, temperature=0.0)
    a = Sequence("a", [1, 2, 3, 4], params, arrival_time=0.0)
    b = Sequence("b", [1, 2, 3, 4, 5, 6, 7, 8], params, arrival_time=1.0)
    for seq in (a, b):
        sch.add(seq)
    sch.on_step_done(sch.schedule())
    for seq in (a, b):
        seq.token_ids.append(9)
    assert bm.num_free_blocks == 2  # each needs one more block to decode its next token
    out = sch.schedule()  # drafts for a would need both
    assert not out.preempted
    assert [(c.seq.request_id, c.num_spec) for c in out.chunks] == [("a", 0), ("b", 0)]


def test_speculation_over_a_quantized_model(tiny_cache_dir, reference):
    """The drafts are checked by the quantized model itself: its greedy output, unchanged;
    the version names both."""
    reqs, _ = reference
    quantized, _ = run(make(tiny_cache_dir, quantization="int8"), reqs)
    parts = make(tiny_cache_dir, quantization="int8", speculative="ngram",
                 speculative_max_batch=16)
    got, _ = run(parts, reqs)
    assert got == quantized and parts.core.state().spec_accepted_tokens > 0
    assert parts.versions.versions.engine.endswith("+int8+spec-ngram-k4-b16")


def test_drafts_never_take_the_blocks_a_later_prefill_chunk_needs():
    from backend.engine.block_manager import BlockManager
    from backend.engine.scheduler import Scheduler
    from backend.engine.sequence import Sequence

    bm = BlockManager(8, 4)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
                    watermark=0, num_spec_tokens=4, spec_max_batch=4)
    params = SamplingParams(max_tokens=20, temperature=0.0)
    a = Sequence("a", [1, 2, 3], params, arrival_time=0.0)
    b = Sequence("b", list(range(10, 50)), params, arrival_time=1.0)  # chunked prefill
    for seq in (a, b):
        sch.add(seq)
    sch.on_step_done(sch.schedule())  # a: its 3 tokens, b: 13 of 40
    a.token_ids.append(9)
    out = sch.schedule()  # b's next chunk of 15 takes every free block
    assert not out.preempted
    assert [(c.seq.request_id, c.num_new_tokens, c.num_spec) for c in out.chunks] == \
        [("a", 1, 0), ("b", 15, 0)]


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_n_choices_with_speculation(tiny_cache_dir, draft_dir, method, temperature):
    """A prompt whose last prefill chunk is one token forks into its n choices before any
    of them drafts; every choice comes back whole; no block is shared where a choice
    writes (the run helper checks block counts, ``BlockManager.check_invariants``)."""
    spec = "ngram" if method == "ngram" else f"draft:{draft_dir}"
    parts = make(tiny_cache_dir, speculative=spec, speculative_max_batch=16,
                 max_num_batched_tokens=16)
    prompt = ([5, 6, 7] * 10)[:17]  # 16 + 1: the second chunk is one token
    params = SamplingParams(max_tokens=12, temperature=temperature, n=3, ignore_eos=True)
    core = parts.core
    core.add_request("r", prompt, params)
    per_choice: dict[int, list[int]] = {}
    for _ in range(200):
        if not core.has_work():
            break
        for d in core.step():
            per_choice.setdefault(d.index, []).extend(d.token_ids)
        for seq in core.scheduler.running:
            assert len(seq.block_table) <= core.block_manager.blocks_needed(seq.num_tokens)
    assert {i: len(t) for i, t in per_choice.items()} == {0: 12, 1: 12, 2: 12}
    assert core.state().spec_proposed_tokens > 0
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    if temperature == 0.0:  # greedy choices are the plain greedy answer, each
        plain = make(tiny_cache_dir)
        plain.core.add_request("p", prompt, SamplingParams(max_tokens=12, temperature=0.0,
                                                           ignore_eos=True))
        want: list[int] = []
        while plain.core.has_work():
            for d in plain.core.step():
                want.extend(d.token_ids)
        assert all(t == want for t in per_choice.values())


def test_copy_on_write_covers_every_shared_block_a_step_writes():
    from backend.engine.block_manager import BlockManager
    from backend.engine.sequence import Sequence

    bm = BlockManager(16, 4)
    parent = Sequence("p", list(range(1, 10)), SamplingParams(max_tokens=8))
    assert bm.allocate(parent, [], 12, reserve=0)  # 3 blocks, as if drafts had been kept
    parent.num_computed_tokens = 6
    child = Sequence("p", list(range(1, 10)), SamplingParams(max_tokens=8), index=1)
    bm.fork(parent, child)
    assert bm.ensure(child, 12)  # writes blocks 1 and 2: both shared, both copied
    assert [bm.ref_counts[b] for b in child.block_table] == [2, 1, 1]
    assert len(bm.take_copies()) == 2
    bm.check_invariants()


def test_speculation_goes_on_when_every_free_block_holds_a_cached_prefix(tiny_cache_dir):
    """A long-running server's free blocks all hold cached prefixes: drafts still get
    blocks (the least recently used ones), as every allocation does."""
    parts = make(tiny_cache_dir, speculative="ngram", kv_blocks=48)
    warm = [(f"w{i}", [100 + i] * 3 + list(range(200 + 40 * i, 240 + 40 * i)),
             SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                            speculative=False)) for i in range(6)]
    run(parts, warm, stagger=1)
    bm = parts.core.block_manager
    assert bm.num_cached_free_blocks >= bm.num_blocks - 2  # (partial tail blocks aren't)
    run(parts, [("r", [7, 8, 9] * 10, SamplingParams(max_tokens=30, temperature=0.0,
                                                    ignore_eos=True))])
    assert parts.core.state().spec_accepted_tokens > 0
