"""The HTTP bench's raw client against a real server: token counts, keep-alive, failures."""

from __future__ import annotations

import pytest

from backend.bench.http import HttpSide, Job

from .conftest import Backend


def side_for(backend: Backend) -> HttpSide:
    side = HttpSide(concurrency=2)
    side.port = backend.port  # drive the shared server instead of starting one
    return side


async def test_counts_tokens_and_reuses_the_connection(backend: Backend) -> None:
    side = side_for(backend)
    try:
        assert await side.one(Job([5, 6, 7, 8], 7)) == 7
        (conn,) = side.idle
        assert await side.one(Job([9, 10], 12)) == 12
        assert side.idle == [conn]  # kept alive and reused
    finally:
        for c in side.idle:
            c.close()


async def test_a_closed_idle_connection_is_replaced(backend: Backend) -> None:
    side = side_for(backend)
    try:
        assert await side.one(Job([5, 6], 3)) == 3
        (stale,) = side.idle
        stale.close()  # as when the server times out an idle keep-alive connection
        assert await side.one(Job([5, 6], 4)) == 4
        assert len(side.idle) == 1 and side.idle[0] is not stale
    finally:
        for c in side.idle:
            c.close()


async def test_an_error_answer_raises(backend: Backend) -> None:
    side = side_for(backend)
    with pytest.raises(RuntimeError, match="400"):
        await side.one(Job([5, 6], 0))  # max_tokens 0: a 400, not a stream


async def test_every_side_of_the_bench_generates_the_same_tokens(backend: Backend) -> None:
    """The bare loop, the engine API and HTTP run one workload to the same token count
    (the bench refuses a run where they differ), and the loop keeps its concurrency."""
    from backend.bench.http import ApiSide, LoopSide, _closed_loop, make_workload

    jobs = make_workload(9, seed=3)
    want = sum(j.max_tokens for j in jobs)
    loop = LoopSide()
    count, seconds = loop.run(jobs, 4)
    assert count == want and seconds > 0
    st = loop.core.state()
    assert st.running == 0 and st.kv_blocks_free == st.kv_blocks_total
    async with ApiSide() as api:
        assert (await _closed_loop(jobs, 4, api.one))[0] == want
    side = side_for(backend)
    try:
        assert (await _closed_loop(jobs, 4, side.one))[0] == want
    finally:
        for c in side.idle:
            c.close()
