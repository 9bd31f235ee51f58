"""The bench's static-batching baseline (``backend/bench/static_batching.py``): a batch runs
to completion with its padding computed, and no padding row ever reaches a caller."""

from __future__ import annotations

from pathlib import Path

from backend.bench.static_batching import (
    PaddedRunner,
    StaticBatchScheduler,
    with_static_batching,
)
from backend.engine.block_manager import BlockManager
from backend.engine.builder import build_engine
from backend.engine.config import EngineConfig
from backend.engine.engine import LLMEngine
from backend.engine.outputs import OutputDelta
from backend.engine.sampling import SamplingParams
from tests.backend.engine.scripted import ScriptedRunner, make_engine

REAL = {"short", "long", "late"}


def static_engine(**kw: int) -> tuple[LLMEngine, StaticBatchScheduler, ScriptedRunner]:
    sched = StaticBatchScheduler(BlockManager(64, 4), max_num_seqs=kw.get("max_num_seqs", 4),
                                 max_num_batched_tokens=kw.get("budget", 64),
                                 max_model_len=kw.get("max_model_len", 64))
    model = ScriptedRunner({})
    return make_engine({}, scheduler=sched, runner=PaddedRunner(model, sched)), sched, model


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_a_batch_runs_to_completion_padded_and_only_callers_rows_report() -> None:
    eng, sched, model = static_engine()
    finals: dict[str, OutputDelta] = {}

    def step() -> list[OutputDelta]:
        out = eng.step()
        assert {d.request_id for d in out} <= REAL  # padding never reports
        finals.update((d.request_id, d) for d in out if d.finished)
        assert eng.state().running == len(sched.running) <= 2  # nor counts as running
        sched.bm.check_invariants()
        return out

    eng.add_request("short", [1] * 2, params(2))
    eng.add_request("long", [2] * 9, params(6))
    assert {d.request_id for d in step()} == {"short", "long"}
    # one forward pass: both prompts and a 7-token row padding "short" to "long"'s 9
    assert sorted(model.steps[0]) == [("long", 9), ("short", 2), ("short#pad", 7)]
    assert sched.padding == []  # the prompt padding is freed once computed
    eng.add_request("late", [3] * 2, params(1))
    steps = 1
    first_step_of_late = None
    while eng.has_work():
        steps += 1
        if any(d.request_id == "late" for d in step()) and first_step_of_late is None:
            first_step_of_late = steps
    # "late" starts only once "long" (6 tokens) has finished: the batch is not joined, and
    # "short" (2 tokens) kept computing as a padding row in the meantime.
    assert first_step_of_late == 7
    assert [len(s) for s in model.steps[:7]] == [3, 2, 2, 2, 2, 2, 1]
    assert ("short#done", 1) in model.steps[3]
    assert {r: d.num_output_tokens for r, d in finals.items()} == \
        {"short": 2, "long": 6, "late": 1}
    assert eng.block_manager.num_free_blocks == 64 and sched.padding == []


def test_a_finished_rows_id_is_free_and_aborting_it_is_a_no_op() -> None:
    eng, sched, _ = static_engine()
    eng.add_request("short", [1] * 2, params(1))
    eng.add_request("long", [2] * 4, params(5))
    eng.step()  # "short" is done after its first token, and computes on as padding
    assert [s.request_id for s in sched.padding] == ["short#done"]
    assert eng.abort("short") is None and len(sched.padding) == 1
    eng.add_request("short", [1] * 2, params(1))  # the id is free: it waits for the batch
    assert eng.state().waiting == 1
    # aborting the last real row of the batch ends it: the padding goes with it
    final = eng.abort("long")
    assert final is not None and final.finish_reason == "abort"
    assert sched.padding == [] and not sched.running
    out = eng.step()  # the next batch
    assert [d.request_id for d in out] == ["short"]
    assert eng.block_manager.num_free_blocks == 64


def test_padding_gives_way_to_real_rows_when_the_blocks_run_out() -> None:
    eng, sched, _ = static_engine(max_model_len=64)
    sched.bm = BlockManager(8, 4)  # 32 token slots for two rows and the padding
    eng.block_manager = sched.bm
    eng.add_request("a", [1] * 4, params(1))
    eng.add_request("b", [2] * 4, params(20))
    while eng.has_work():
        for d in eng.step():
            assert d.request_id in {"a", "b"}
    assert sched.bm.num_free_blocks == 8


def test_static_batching_on_the_real_engine_changes_no_output(tiny_cache_dir: Path) -> None:
    """Greedy tokens are the same with static as with continuous batching: padding rows are
    computed alongside, never into, the callers' rows."""
    cfg = EngineConfig(model="tiny", cache_dir=str(tiny_cache_dir), device="cpu",
                       dtype="float32", block_size=4, kv_blocks=256, max_num_seqs=4,
                       max_num_batched_tokens=32)
    prompts = {"a": [5, 6, 7], "b": list(range(10, 40)), "c": [9] * 11, "d": [7, 8]}
    lengths = {"a": 9, "b": 3, "c": 6, "d": 12}

    def tokens(core: LLMEngine) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {rid: [] for rid in prompts}
        for rid, prompt in prompts.items():
            core.add_request(rid, prompt, params(lengths[rid]))
        while core.has_work():
            for d in core.step():
                out[d.request_id].extend(d.token_ids)
        assert core.block_manager.num_free_blocks == 256
        return out

    continuous = build_engine(cfg)
    static = with_static_batching(build_engine(cfg))
    assert isinstance(static.core.scheduler, StaticBatchScheduler)
    assert static.core.limits == continuous.core.limits
    assert tokens(static.core) == tokens(continuous.core)
