"""The seam between the request streams (``AsyncEngine``) and the core's transport, over a
fake ``CoreTransport`` that the test steps by hand: no thread, no process, no model.

What the front owes the server: validation before anything is queued, outputs routed to
their stream in order, ``on_final`` for every final delta (also of streams already
closed), an abort when a stream is left early, and on the core's death: every open stream
fails with ``EngineDeadError``, ``on_dead`` is called once, ``generate`` refuses.
"""

from __future__ import annotations

import asyncio

import pytest

from backend.engine.async_engine import AsyncEngine
from backend.engine.errors import EngineDeadError, InvalidRequestError, PromptTooLongError
from backend.engine.limits import RequestLimits
from backend.engine.outputs import EngineState, OutputDelta
from backend.engine.sampling import SamplingParams
from backend.engine.transport import AddRequest, CoreEvents, EngineInfo

LIMITS = RequestLimits(vocab_size=100, max_model_len=32)
STATE = EngineState(kv_blocks_total=8, kv_blocks_free=8, kv_blocks_cached=0, block_size=4,
                    running=0, waiting=0, preemptions=0, prefix_cache_queries=0,
                    prefix_cache_hits=0, prefix_cache_query_tokens=0, prefill_tokens_saved=0,
                    prefix_cache_evictions=0, max_num_seqs=4, max_num_batched_tokens=16,
                    max_model_len=32, steps=0, generated_tokens=0, aborted=0,
                    max_tokens_after_abort=0)


class FakeTransport:
    """A core the test drives: it records what the front sends and emits what it is told."""

    def __init__(self) -> None:
        self.added: list[AddRequest] = []
        self.aborted: list[str] = []
        self.events: CoreEvents | None = None
        self.started = self.stopping = self.dead = False
        self.now = 100.0
        self.snapshot = STATE
        self.refuse_adds = False
        self.finished: set[str] = set()

    @property
    def info(self) -> EngineInfo | None:
        return None

    @property
    def limits(self) -> RequestLimits:
        return LIMITS

    def clock(self) -> float:
        return self.now

    @property
    def accepting(self) -> bool:
        return self.started and not self.stopping and not self.dead

    @property
    def alive(self) -> bool:
        return self.started and not self.dead

    async def start(self, events: CoreEvents) -> None:
        self.events, self.started = events, True

    async def shutdown(self) -> None:
        self.stopping = True
        assert self.events is not None
        self.events.deliver([final(r.request_id, "abort") for r in self.added
                             if r.request_id not in self.finished], [])
        self.events.stopped(None)

    def add(self, request: AddRequest) -> None:
        if self.refuse_adds:
            raise EngineDeadError("the socket is gone")
        self.added.append(request)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def state(self) -> EngineState:
        return self.snapshot

    # ---- the test's hand on the core ----
    def emit(self, *deltas: OutputDelta, refusals: list[tuple[str, Exception]] = ()) -> None:
        assert self.events is not None
        for d in deltas:
            if d.finished:
                self.finished.add(d.request_id)
        self.events.deliver(list(deltas), list(refusals))

    def die(self) -> None:
        self.dead = True
        assert self.events is not None
        self.events.stopped(EngineDeadError("the engine process exited (code -9)"))


def token(rid: str, tok: int) -> OutputDelta:
    return OutputDelta(rid, chr(ord("a") + tok), (tok,), (1.0,), False, None, 2, 0, 1)


def final(rid: str, reason: str = "length") -> OutputDelta:
    return OutputDelta(rid, "", (), (), True, reason, 2, 0, 1)


def greedy(n: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


async def started() -> tuple[AsyncEngine, FakeTransport]:
    core = FakeTransport()
    engine = AsyncEngine(core)
    await engine.start()
    return engine, core


async def test_outputs_reach_their_stream_in_order_and_on_final_sees_every_final() -> None:
    engine, core = await started()
    finals: list[OutputDelta] = []
    engine.on_final = finals.append
    a = await engine.generate("a", [1, 2], greedy(), priority=3, cache_salt="s")
    b = await engine.generate("b", [3], greedy())
    assert core.added[0] == AddRequest("a", [1, 2], greedy(), 3, "s", 100.0)  # its clock
    core.emit(token("a", 1), token("b", 7), token("a", 2))
    core.emit(final("b"), final("a"))
    assert [d.token_ids for d in [x async for x in a]] == [(1,), (2,), ()]
    assert [d.token_ids for d in [x async for x in b]] == [(7,), ()]
    assert [d.request_id for d in finals] == ["b", "a"]
    assert engine.state() is core.snapshot and engine.is_running
    await engine.generate("a", [1], greedy())  # a finished id may run again


async def test_invalid_requests_raise_before_anything_is_queued() -> None:
    engine, core = await started()
    with pytest.raises(PromptTooLongError):
        await engine.generate("long", [1] * 32, greedy())
    with pytest.raises(InvalidRequestError):
        await engine.generate("vocab", [100], greedy())
    with pytest.raises(InvalidRequestError):
        await engine.generate("prio", [1], greedy(), priority=True)  # type: ignore[arg-type]
    running = await engine.generate("dup", [1], greedy())
    with pytest.raises(InvalidRequestError):
        await engine.generate("dup", [1], greedy())
    assert [r.request_id for r in core.added] == ["dup"] and not running._done


async def test_a_refusal_from_the_core_fails_only_its_stream() -> None:
    engine, core = await started()
    bad = await engine.generate("bad", [1], greedy())
    ok = await engine.generate("ok", [1], greedy())
    core.emit(final("ok"), refusals=[("bad", InvalidRequestError("no", "prompt"))])
    with pytest.raises(InvalidRequestError):
        await anext(bad)
    assert (await anext(ok)).finished


async def test_leaving_a_stream_aborts_its_request_once() -> None:
    engine, core = await started()
    finals: list[OutputDelta] = []
    engine.on_final = finals.append
    stream = await engine.generate("gone", [1], greedy(20))
    core.emit(token("gone", 1))
    async for _ in stream:
        break
    await stream.aclose()
    await stream.aclose()
    assert core.aborted == ["gone"]
    core.emit(final("gone", "abort"))  # nobody reads it; the server's telemetry does
    assert finals[-1].finish_reason == "abort"
    # a consumer cancelled while it waits aborts too
    waiting = await engine.generate("cancelled", [1], greedy())
    task = asyncio.create_task(anext(waiting))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert core.aborted == ["gone", "cancelled"]
    # a finished stream has nothing to abort
    done = await engine.generate("done", [1], greedy())
    core.emit(final("done"))
    await anext(done)
    await done.aclose()
    assert core.aborted == ["gone", "cancelled"]


async def test_a_dead_core_fails_every_stream_and_calls_on_dead_once() -> None:
    engine, core = await started()
    dead: list[bool] = []
    engine.on_dead = lambda: dead.append(True)
    streams = [await engine.generate(f"r{i}", [1], greedy()) for i in range(3)]
    core.emit(token("r0", 1))
    core.die()
    assert not engine.is_running and dead == [True]
    assert (await anext(streams[0])).token_ids == (1,)  # what came before still comes
    for s in streams:
        with pytest.raises(EngineDeadError):
            await anext(s)
    with pytest.raises(EngineDeadError):
        await engine.generate("after", [1], greedy())
    assert [r.request_id for r in core.added] == ["r0", "r1", "r2"]


async def test_shutdown_ends_streams_with_their_abort_and_is_no_death() -> None:
    engine, _core = await started()
    dead: list[bool] = []
    engine.on_dead = lambda: dead.append(True)
    stream = await engine.generate("s", [1], greedy())
    await engine.shutdown()
    assert [d.finish_reason async for d in stream] == ["abort"]
    assert dead == []
    with pytest.raises(EngineDeadError):
        await engine.generate("after", [1], greedy())


async def test_an_add_the_transport_cannot_send_leaves_no_stream_behind() -> None:
    engine, core = await started()
    core.refuse_adds = True
    with pytest.raises(EngineDeadError):
        await engine.generate("x", [1], greedy())
    core.refuse_adds = False
    await engine.generate("x", [1], greedy())  # the id is free again


async def test_before_start_nothing_is_accepted() -> None:
    engine = AsyncEngine(FakeTransport())
    with pytest.raises(EngineDeadError, match="not started"):
        await engine.generate("x", [1], greedy())
