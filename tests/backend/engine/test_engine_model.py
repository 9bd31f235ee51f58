"""The engine with the real (tiny) model: batching, preemption and the prefix cache never
change results, seeds are batch-independent, aborts free the KV cache."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from backend.engine.async_engine import AsyncEngine
from backend.engine.builder import EngineParts, build_engine
from backend.engine.config import EngineConfig
from backend.engine.engine import StepHook
from backend.engine.outputs import OutputDelta
from backend.engine.sampling import SamplingParams
from backend.engine.thread_transport import ThreadTransport


def make(cache: Path, step_hook: StepHook | None = None, **kw) -> EngineParts:
    base = {"model": "tiny", "cache_dir": str(cache), "device": "cpu", "dtype": "float32",
            "block_size": 4, "kv_blocks": 256, "max_num_seqs": 16,
            "max_num_batched_tokens": 24}
    base.update(kw)
    return build_engine(EngineConfig(**base), step_hook=step_hook)


def run(parts: EngineParts, requests: list[tuple[str, list[int], SamplingParams]],
        cache_salt: str | None = None) -> dict[str, list[int]]:
    core = parts.core
    for rid, prompt, params in requests:
        core.add_request(rid, prompt, params, cache_salt=cache_salt)
    out: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    finals: dict[str, OutputDelta] = {}
    for _ in range(10_000):
        if not core.has_work():
            break
        for d in core.step():
            out[d.request_id].extend(d.token_ids)
            if d.finished:
                finals[d.request_id] = d
    assert set(finals) == set(out), "some request never finished"
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    core.block_manager.check_invariants()
    return out


def workload(n: int, seed: int, vocab: int, greedy: bool = True, tag: str = "r"):
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 70))]
        params = SamplingParams(max_tokens=rng.randint(4, 30), ignore_eos=True,
                                temperature=0.0 if greedy else 0.9, top_p=0.95, top_k=50,
                                seed=None if greedy else 1000 + i)
        reqs.append((f"{tag}{i}", prompt, params))
    return reqs


def alone(parts: EngineParts, reqs) -> dict[str, list[int]]:
    result: dict[str, list[int]] = {}
    for r in reqs:
        result.update(run(parts, [r]))
    return result


@pytest.fixture(scope="module")
def reference(tiny_cache_dir: Path):
    parts = make(tiny_cache_dir, enable_prefix_cache=False, max_num_batched_tokens=512)
    vocab = parts.model_config.vocab_size
    greedy = workload(10, 1, vocab)
    sampled = workload(6, 2, vocab, greedy=False, tag="s")
    return vocab, alone(parts, greedy), alone(parts, sampled), greedy, sampled


def test_continuous_batching_equals_running_alone(tiny_cache_dir, reference):
    _vocab, ref_greedy, _, greedy, _ = reference
    parts = make(tiny_cache_dir, enable_prefix_cache=False)
    got = run(parts, greedy)
    assert got == ref_greedy
    assert parts.core.steps < sum(len(v) for v in ref_greedy.values())  # really batched


def test_preempted_requests_resume_to_the_same_output(tiny_cache_dir, reference):
    _vocab, ref_greedy, _, greedy, _ = reference
    parts = make(tiny_cache_dir, kv_blocks=30)  # 120 token slots for ~10 requests
    got = run(parts, greedy)
    assert parts.core.state().preemptions > 0
    assert got == ref_greedy


def test_prefix_cache_hits_do_not_change_output(tiny_cache_dir):
    parts_nc = make(tiny_cache_dir, enable_prefix_cache=False)
    vocab = parts_nc.model_config.vocab_size
    rng = random.Random(7)
    system = [rng.randrange(3, vocab) for _ in range(37)]
    reqs = [(f"p{i}", system + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 9))],
             SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)) for i in range(6)]
    expected = alone(parts_nc, reqs)
    parts = make(tiny_cache_dir)
    first = run(parts, reqs[:1])
    rest = run(parts, reqs[1:])
    st = parts.core.state()
    assert st.prefix_cache_hits >= 5 and st.prefill_tokens_saved >= 5 * 36
    assert {**first, **rest} == expected
    # Another salt gets no hit and still the same tokens.
    again = run(parts, [("salted", reqs[0][1], reqs[0][2])], cache_salt="tenant-b")
    assert again["salted"] == expected["p0"]
    assert parts.core.state().prefix_cache_hits == st.prefix_cache_hits


def test_seeded_sampling_is_batch_independent(tiny_cache_dir, reference):
    vocab, _, ref_sampled, _, sampled = reference
    parts = make(tiny_cache_dir)
    got = run(parts, sampled + workload(5, 3, vocab, tag="g"))  # batched with greedy neighbours
    assert {k: got[k] for k in ref_sampled} == ref_sampled
    # and different seeds give different continuations
    rid, prompt, p = sampled[0]
    other = SamplingParams(max_tokens=p.max_tokens, temperature=0.9, top_p=0.95, top_k=50,
                           seed=424242, ignore_eos=True)
    assert run(parts, [("x", prompt, other)])["x"] != ref_sampled[rid]


def test_stop_strings_and_text_match_decode(tiny_cache_dir):
    parts = make(tiny_cache_dir)
    tok = parts.tokenizer
    prompt = tok.encode("The cache")
    full = run(parts, [("a", prompt, SamplingParams(max_tokens=24, temperature=0,
                                                   ignore_eos=True))])["a"]
    text = tok.decode(full)
    # Stop at a piece of the greedy text that starts mid-way: output is cut right before.
    cut = len(text) // 2
    stop = text[cut:cut + 3]
    first = text.find(stop)
    core = parts.core
    core.add_request("b", prompt, SamplingParams(max_tokens=24, temperature=0, stop=(stop,),
                                                 ignore_eos=True))
    deltas = []
    while core.has_work():
        deltas.extend(core.step())
    assert "".join(d.text for d in deltas) == text[:first]
    assert deltas[-1].finish_reason == "stop"


async def test_abort_with_real_model_frees_everything(tiny_cache_dir):
    parts = make(tiny_cache_dir, max_num_seqs=2)
    eng = AsyncEngine(ThreadTransport(parts.core, parts.info()))
    async with eng:
        streams = [await eng.generate(f"r{i}", [5] * 40, SamplingParams(
            max_tokens=200, temperature=0, ignore_eos=True)) for i in range(5)]
        firsts = [await anext(s) for s in streams[:2]]  # two decoding, three waiting
        assert all(not d.finished for d in firsts)
        for s in streams:
            await s.aclose()
        for _ in range(200):
            st = eng.state()
            if st.running == 0 and st.waiting == 0 and st.kv_blocks_free == st.kv_blocks_total:
                break
            await asyncio.sleep(0.005)
        st = eng.state()
        assert (st.running, st.waiting) == (0, 0)
        assert st.kv_blocks_free == st.kv_blocks_total
        assert st.aborted == 5 and st.max_tokens_after_abort <= 2


def test_num_threads_sets_torch_threads(tiny_cache_dir):
    import torch

    from backend.engine.errors import InvalidRequestError

    before = torch.get_num_threads()
    try:
        make(tiny_cache_dir, num_threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(InvalidRequestError):
        EngineConfig(num_threads=0)


def test_reserve_cores_leaves_cores_to_the_server(monkeypatch):
    import os

    import torch

    from backend.engine.builder import cpu_threads
    from backend.engine.errors import InvalidRequestError

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert cpu_threads(EngineConfig(reserve_cores=1), cpu) == 7
    assert cpu_threads(EngineConfig(reserve_cores=3), cpu) == 5
    assert cpu_threads(EngineConfig(), cpu) is None  # torch's default
    assert cpu_threads(EngineConfig(reserve_cores=1), cuda) is None
    assert cpu_threads(EngineConfig(num_threads=4, reserve_cores=1), cpu) == 4  # explicit wins
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert cpu_threads(EngineConfig(reserve_cores=1), cpu) == 1  # never below one
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpu_threads(EngineConfig(reserve_cores=1), cpu) is None  # the operator chose
    with pytest.raises(InvalidRequestError):
        EngineConfig(reserve_cores=-1)


def test_the_step_hook_runs_before_every_model_step(tiny_cache_dir):
    """The injected step hook (fault injection's seam) runs once in every step that runs
    the model, just before it, and changes no output; a step with nothing to run skips it."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    plain = run(make(tiny_cache_dir), [("a", [5, 6, 7], params)])
    events: list[str] = []
    slow = make(tiny_cache_dir, step_hook=lambda: events.append("hook"))
    execute = slow.runner.execute

    def model(chunks):
        events.append("model")
        return execute(chunks)

    slow.runner.execute = model  # type: ignore[method-assign]
    assert run(slow, [("a", [5, 6, 7], params)]) == plain
    assert events == ["hook", "model"] * 6  # one prefill step, five decode steps
    assert slow.core.step() == [] and len(events) == 12


def test_the_builder_hands_the_step_hook_to_the_engine(tiny_cache_dir):
    def hook() -> None:
        pass

    assert make(tiny_cache_dir, step_hook=hook).core.step_hook is hook
    assert make(tiny_cache_dir).core.step_hook is None
