"""Engine core (LLMEngine, AsyncEngine over a ThreadTransport) against a scripted model:
stop handling, aborts, the asyncio front. The real model is covered in
test_engine_model.py."""

from __future__ import annotations

import asyncio

import pytest

from backend.engine.async_engine import AsyncEngine
from backend.engine.errors import EngineDeadError, InvalidRequestError, PromptTooLongError
from backend.engine.sampling import SamplingParams
from backend.engine.sequence import SequenceStatus
from backend.engine.stop import StopStringMatcher
from backend.engine.thread_transport import ThreadTransport

from .scripted import EOS, VOCAB, make_engine, run_all, slow_down


def text_of(ds) -> str:
    return "".join(d.text for d in ds)


def test_stop_string_across_token_boundary_is_not_emitted():
    # "a" "b" | "ab" "c": stop "bab" spans three tokens.
    eng = make_engine({3: [1, 2, 27, 3, 4]})
    eng.add_request("r", [3, 3], SamplingParams(max_tokens=10, temperature=0, stop=("bab",)))
    ds = run_all(eng)["r"]
    assert text_of(ds) == "a"
    assert ds[-1].finished and ds[-1].finish_reason == "stop"
    assert ds[-1].num_output_tokens == 3


def test_eos_and_stop_token_ids_and_ignore_eos_and_length():
    eng = make_engine({3: [1, 2, EOS, 4], 4: [1, 28, 2], 5: [1, EOS, 2]})
    eng.add_request("eos", [3], SamplingParams(max_tokens=10, temperature=0))
    eng.add_request("stopid", [4], SamplingParams(max_tokens=10, temperature=0,
                                                  stop_token_ids=(28,)))
    eng.add_request("ign", [5], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    out = run_all(eng)
    assert text_of(out["eos"]) == "ab" and out["eos"][-1].finish_reason == "stop"
    assert text_of(out["stopid"]) == "a" and out["stopid"][-1].finish_reason == "stop"
    assert out["ign"][-1].finish_reason == "length" and out["ign"][-1].num_output_tokens == 4
    assert eng.block_manager.num_free_blocks == 64


def test_partial_stop_is_released_at_the_end():
    eng = make_engine({3: [1, 2, 24]})  # "abx", stop "xyz" never completes
    eng.add_request("r", [3], SamplingParams(max_tokens=3, temperature=0, stop=("xyz",)))
    ds = run_all(eng)["r"]
    assert text_of(ds) == "abx" and ds[-1].finish_reason == "length"
    # "x" was held back until the end, not emitted on its own step
    assert ds[-1].text.endswith("x")


def test_stop_matcher_unit():
    m = StopStringMatcher(("</s>", "STOP"))
    assert m.feed("hello <") == ("hello ", False)
    assert m.feed("/") == ("", False)
    assert m.feed("x") == ("</x", False)
    assert m.feed(" ST") == (" ", False)
    assert m.feed("OP and more") == ("", True)


def test_validation_errors_are_typed():
    eng = make_engine({})
    with pytest.raises(InvalidRequestError):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError):
        SamplingParams(max_tokens="5")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError):
        SamplingParams(temperature=-1)
    with pytest.raises(PromptTooLongError):
        eng.add_request("r", [1] * 64, SamplingParams(max_tokens=1))
    with pytest.raises(PromptTooLongError):
        eng.add_request("r", [1] * 60, SamplingParams(max_tokens=5))
    with pytest.raises(InvalidRequestError):
        eng.add_request("r", [VOCAB], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError):
        eng.add_request("r", [], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError):
        eng.add_request("r", [1], SamplingParams(max_tokens=1), priority="high")  # type: ignore
    eng.add_request("dup", [1], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError):
        eng.add_request("dup", [1], SamplingParams(max_tokens=1))


@pytest.mark.parametrize("phase", ["waiting", "prefilling", "decoding", "preempted"])
def test_abort_from_every_state_frees_blocks_before_next_step(phase):
    eng = make_engine({}, max_num_batched_tokens=8, max_num_seqs=1)
    eng.add_request("a", [1] * 20, SamplingParams(max_tokens=30, temperature=0))
    eng.add_request("b", [2] * 4, SamplingParams(max_tokens=30, temperature=0))
    if phase == "prefilling":
        eng.step()  # 8 of a's 20 prompt tokens
        assert eng.status_of("a") is SequenceStatus.RUNNING
    elif phase == "decoding":
        for _ in range(4):
            eng.step()
        assert eng.scheduler.get("a").num_output_tokens >= 1
    elif phase == "preempted":
        for _ in range(4):
            eng.step()
        eng.scheduler.preempt(eng.scheduler.get("a"))
        assert eng.status_of("a") is SequenceStatus.WAITING
    target = "b" if phase == "waiting" else "a"
    delta = eng.abort(target)
    assert delta is not None and delta.finished and delta.finish_reason == "abort"
    assert eng.status_of(target) is None
    held = sum(len(s.block_table) for s in eng.scheduler.running)
    assert eng.block_manager.num_free_blocks == 64 - held
    assert eng.abort(target) is None  # finished: no-op
    assert eng.abort("unknown") is None
    run_all(eng)
    assert eng.block_manager.num_free_blocks == 64
    eng.block_manager.check_invariants()


async def test_async_engine_stream_and_cancel():
    eng = make_engine({3: [1, 2, 3, 4, 5, 6, 7, 8]})
    aeng = AsyncEngine(ThreadTransport(eng))
    async with aeng:
        stream = await aeng.generate("ok", [3], SamplingParams(max_tokens=5, temperature=0,
                                                                ignore_eos=True))
        got = [d async for d in stream]
        assert "".join(d.text for d in got) == "abcde"
        assert got[-1].metrics is not None and got[-1].metrics.ttft is not None
        with pytest.raises(InvalidRequestError):
            await aeng.generate("bad", [1] * 100, SamplingParams(max_tokens=1))
        # A consumer that leaves early aborts the request and frees its blocks. Steps are
        # slowed to 5 ms, so that the 50 tokens take longer than the abort takes to land.
        slow_down(eng)
        stream = await aeng.generate("gone", [3], SamplingParams(max_tokens=50, temperature=0,
                                                                  ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(100):
            st = aeng.state()
            if st.running == 0 and st.waiting == 0 and st.kv_blocks_free == 64:
                break
            await asyncio.sleep(0.01)
        st = aeng.state()
        assert (st.running, st.waiting, st.kv_blocks_free, st.aborted) == (0, 0, 64, 1)
        assert st.max_tokens_after_abort <= 2


def test_prefill_chunks_are_recorded_with_their_step_times():
    ticks = iter(range(1, 10_000))
    eng = make_engine({3: [1, 2, 3]}, max_num_batched_tokens=8, clock=lambda: float(next(ticks)))
    prompt = [3] + list(range(4, 23))  # 20 tokens: chunks of 8, 8, 4 (budget 8)
    eng.add_request("a", prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    m = run_all(eng)["a"][-1].metrics
    assert m is not None and m.first_token_time is not None
    assert [(start, n) for start, n, _, _ in m.prefill_chunks] == [(0, 8), (8, 8), (16, 4)]
    for _, _, t0, t1 in m.prefill_chunks:
        assert m.first_scheduled_time <= t0 < t1 <= m.first_token_time
    assert m.prefill_chunks[-1][3] == m.first_token_time  # the last chunk samples it
    assert len(m.token_times) == 3  # decode steps are not prefill chunks
    # The same prompt again: the prefix cache serves whole blocks, the first chunk starts
    # after them.
    eng.add_request("b", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    final = run_all(eng)["b"][-1]
    assert final.num_cached_tokens > 0
    assert final.metrics is not None
    assert final.metrics.prefill_chunks[0][0] == final.num_cached_tokens


def test_abort_reports_when_it_was_asked_and_tokens_after():
    ticks = iter(range(1, 10_000))
    eng = make_engine({3: [1] * 40}, clock=lambda: float(next(ticks)))
    eng.add_request("a", [3, 4], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    for _ in range(3):
        eng.step()
    eng.mark_abort("a")
    eng.step()  # one more token before the abort takes effect
    final = eng.abort("a")
    assert final is not None and final.finish_reason == "abort"
    m = final.metrics
    assert m is not None and m.abort_time is not None and m.finished_time is not None
    assert m.token_times[2] < m.abort_time < m.token_times[3] < m.finished_time
    assert m.tokens_after_abort == 1
    assert [(s, n) for s, n, _, _ in m.prefill_chunks] == [(0, 2)]


async def test_async_engine_hands_every_final_delta_to_on_final():
    eng = make_engine({3: [1] * 50})
    aeng = AsyncEngine(ThreadTransport(eng))
    finals = []
    aeng.on_final = finals.append
    async with aeng:
        stream = await aeng.generate("done", [3], SamplingParams(max_tokens=2, temperature=0,
                                                                  ignore_eos=True))
        got = [d async for d in stream]
        assert finals == [got[-1]]
        # A stream closed early: nobody reads its final delta, on_final still gets it.
        # Steps are slowed to 5 ms, so that the 50 tokens take longer than the abort.
        slow_down(eng)
        stream = await aeng.generate("gone", [3], SamplingParams(max_tokens=50, temperature=0,
                                                                  ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(200):
            if len(finals) == 2:
                break
            await asyncio.sleep(0.01)
        assert finals[1].request_id == "gone" and finals[1].finish_reason == "abort"
        assert finals[1].metrics is not None and finals[1].metrics.abort_time is not None


async def test_a_crashed_step_loop_fails_streams_and_calls_on_dead_once():
    eng = make_engine({3: [1, 2, 3, 4, 5, 6, 7, 8]})
    aeng = AsyncEngine(ThreadTransport(eng))
    dead: list[bool] = []
    aeng.on_dead = lambda: dead.append(True)
    async with aeng:
        stream = await aeng.generate("ok", [3], SamplingParams(max_tokens=40, temperature=0,
                                                                ignore_eos=True))

        def broken(chunks):
            raise RuntimeError("the model broke")

        eng.runner.execute = broken
        with pytest.raises(EngineDeadError):
            async with asyncio.timeout(5):
                async for _ in stream:
                    pass
        await asyncio.sleep(0.05)
        assert dead == [True] and not aeng.is_running
        with pytest.raises(EngineDeadError):
            await aeng.generate("after", [3], SamplingParams(max_tokens=1))
