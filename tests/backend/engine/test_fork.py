"""``n`` > 1: one prefill, ``n`` choices forked onto the prompt's KV blocks.

The prompt is computed once, the choices share its full blocks (the partly filled last
one is copied on write), greedy choices equal the ``n`` = 1 answer, seeded ones are
reproducible and distinct, an abort frees every block, preemption keeps the answers."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from backend.engine.async_engine import AsyncEngine
from backend.engine.builder import EngineParts, build_engine
from backend.engine.config import EngineConfig
from backend.engine.engine import LLMEngine, choice_seed
from backend.engine.errors import InvalidRequestError
from backend.engine.outputs import OutputDelta
from backend.engine.sampling import SamplingParams
from backend.engine.scheduler import ScheduledChunk
from backend.engine.thread_transport import ThreadTransport

from .scripted import make_engine

BS = 4


def make(cache: Path, **kw: object) -> EngineParts:
    base: dict[str, object] = {
        "model": "tiny", "cache_dir": str(cache), "device": "cpu", "dtype": "float32",
        "block_size": BS, "kv_blocks": 256, "max_num_seqs": 16,
        "max_num_batched_tokens": 64}
    base.update(kw)
    return build_engine(EngineConfig(**base))  # type: ignore[arg-type]


def count_prompt_tokens(core: LLMEngine) -> list[int]:
    """Wrap the runner: the box holds how many prompt positions the model computed."""
    box = [0]
    execute = core.runner.execute

    def counting(chunks: list[ScheduledChunk]):  # type: ignore[no-untyped-def]
        for c in chunks:
            box[0] += max(0, min(c.start + c.num_new_tokens, c.seq.num_prompt_tokens) - c.start)
        return execute(chunks)

    core.runner.execute = counting  # type: ignore[method-assign]
    return box


def run(core: LLMEngine, rid: str, prompt: list[int],
        params: SamplingParams) -> tuple[dict[int, list[int]], dict[int, str], OutputDelta]:
    """Tokens and finish reason per choice, and the request's final delta."""
    core.add_request(rid, prompt, params)
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    final = None
    for _ in range(10_000):
        if not core.has_work():
            break
        for d in core.step():
            assert d.request_id == rid and final is None
            tokens.setdefault(d.index, []).extend(d.token_ids)
            if d.finish_reason is not None:
                assert d.index not in reasons
                reasons[d.index] = d.finish_reason
            if d.finished:
                final = d
    assert final is not None and final.metrics is not None
    core.block_manager.check_invariants()
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    return tokens, reasons, final


def prompt_of(n: int, seed: int = 3) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def test_the_prompt_is_prefilled_once_and_greedy_choices_equal_n1(tiny_cache_dir: Path):
    prompt = prompt_of(57)  # 14 full blocks + 1 token: the last block is copied on write
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    one = make(tiny_cache_dir, enable_prefix_cache=False).core
    ref, _, _ = run(one, "one", prompt, greedy)
    four = make(tiny_cache_dir, enable_prefix_cache=False).core
    computed = count_prompt_tokens(four)
    tokens, reasons, final = run(four, "four", prompt, SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True, n=4))
    assert computed[0] == len(prompt)  # once, not 4 times
    assert tokens == {i: ref[0] for i in range(4)}
    assert reasons == {i: "length" for i in range(4)}
    assert final.num_output_tokens == 4 * 12 and final.num_prompt_tokens == len(prompt)
    assert four.generated_tokens == 4 * 12


def test_choices_hold_the_prompt_blocks_once(tiny_cache_dir: Path):
    prompt = prompt_of(50)  # 12 full blocks + 2 tokens
    core = make(tiny_cache_dir).core
    bm = core.block_manager
    core.add_request("r", prompt, SamplingParams(max_tokens=40, temperature=0,
                                                 ignore_eos=True, n=4))
    made: dict[int, int] = {}
    while min(made.values(), default=0) < 9:
        for d in core.step():
            made[d.index] = made.get(d.index, 0) + len(d.token_ids)
    assert made == {i: 9 for i in range(4)}
    held = bm.num_blocks - bm.num_free_blocks
    # the KV of 9 outputs is in the cache (the 9th token's is not computed yet), after the
    # prompt's 2-token tail: each choice holds ceil((2 + 8 + 1) / 4) blocks of its own
    full, tail = divmod(len(prompt), BS)
    own = -(-(tail + 9) // BS)
    assert held == full + 4 * own
    assert held < 4 * -(-(len(prompt) + 9) // BS) // 2  # not 4 × the prompt's blocks
    shared = [b for b in range(bm.num_blocks) if bm.ref_counts[b] == 4]
    assert len(shared) == full
    core.abort("r")
    assert bm.num_free_blocks == bm.num_blocks


def test_seeded_choices_are_reproducible_and_distinct(tiny_cache_dir: Path):
    prompt = prompt_of(30, seed=5)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True, n=4)
    core = make(tiny_cache_dir).core
    first, _, _ = run(core, "a", prompt, params)
    again, _, _ = run(make(tiny_cache_dir).core, "b", prompt, params)
    assert first == again
    assert len({tuple(t) for t in first.values()}) == 4
    # choice 0 is the n = 1 answer with the same seed; choice i, seed choice_seed(seed, i)
    single, _, _ = run(core, "c", prompt, SamplingParams(
        max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True))
    assert single[0] == first[0]
    third, _, _ = run(core, "d", prompt, SamplingParams(
        max_tokens=10, temperature=1.0, seed=choice_seed(1234, 3), ignore_eos=True))
    assert third[0] == first[3]


def test_preempted_choices_resume_to_the_same_tokens(tiny_cache_dir: Path):
    prompt = prompt_of(23, seed=9)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, n=3)
    ref, _, _ = run(make(tiny_cache_dir).core, "ref", prompt, params)
    core = make(tiny_cache_dir, kv_blocks=26).core  # 104 slots for 3 × 53 tokens
    tokens, _, _ = run(core, "tight", prompt, params)
    assert core.state().preemptions > 0
    assert tokens == ref


def test_choices_stop_on_their_own() -> None:
    # the scripted model answers by output position: every choice ends at its EOS
    eng = make_engine({7: [3, 4, 0]})
    eng.add_request("r", [7, 1, 2], SamplingParams(max_tokens=8, temperature=0, n=3))
    deltas = [d for _ in range(20) for d in eng.step()]
    finals = [d for d in deltas if d.finish_reason is not None]
    assert sorted(d.index for d in finals) == [0, 1, 2]
    assert [d.finished for d in finals] == [False, False, True]
    assert finals[-1].num_output_tokens == 9
    assert {d.finish_reason for d in finals} == {"stop"}
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_n_is_validated() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(n=0)
    assert info.value.param == "n"
    with pytest.raises(InvalidRequestError):
        SamplingParams(n=129)


async def test_abort_of_a_forked_request_frees_every_block(tiny_cache_dir: Path):
    parts = make(tiny_cache_dir)
    eng = AsyncEngine(ThreadTransport(parts.core, parts.info()))
    async with eng:
        stream = await eng.generate("r", prompt_of(41), SamplingParams(
            max_tokens=400, temperature=0, ignore_eos=True, n=4))
        seen: set[int] = set()
        while len(seen) < 4:
            d = await anext(stream)
            assert not d.finished
            seen.add(d.index)
        assert eng.state().running == 4
        await stream.aclose()
        for _ in range(400):
            st = eng.state()
            if st.running == 0 and st.kv_blocks_free == st.kv_blocks_total:
                break
            await asyncio.sleep(0.005)
        st = eng.state()
        assert (st.running, st.waiting, st.aborted) == (0, 0, 1)
        assert st.kv_blocks_free == st.kv_blocks_total
    parts.core.block_manager.check_invariants()
