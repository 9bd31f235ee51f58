"""Closed loop (`concurrency`): N requests in flight, never more, each slot sending its next
request when its last one ended (plus the think time); the request cap; the report."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from loadtest.arrivals import requests_in_order, schedule
from loadtest.run import measure_workload
from loadtest.workload import Workload, WorkloadError, parse_workload
from tests.loadtest.sse_server import Reply, SSEServer


def closed(**extra: Any) -> Workload:
    return parse_workload({
        "name": "closed", "seed": 5, "duration_s": 30, "model": "scripted",
        "concurrency": 4,
        "classes": [{"name": "a", "share": 3, "lengths": {"buckets": [{"input": 8,
                                                                          "output": 3}]}},
                    {"name": "b", "share": 1, "lengths": {"pairs": [[20, 3], [30, 3]]}}],
        **extra})


@pytest.fixture
def server() -> Iterator[SSEServer]:
    s = SSEServer(lambda n, body: Reply(chunks=3)).start()
    yield s
    s.stop()


def overlap(records: list[Any]) -> int:
    """The most requests in flight at once, from the client's own stamps."""
    edges = sorted([(r.dispatched, 1) for r in records] + [(r.done, -1) for r in records],
                   key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def test_exactly_n_in_flight_until_the_request_cap() -> None:
    # The first 4 requests are held until all 4 have arrived: the loop must have put 4 in
    # flight (never more: a 5th while the 4 are held would count 5 at the server).
    gate = threading.Event()
    seen: list[int] = []

    def behave(idx: int, body: dict[str, Any]) -> Reply:
        if idx < 0:
            return Reply(chunks=1)  # the start-up probes
        seen.append(idx)
        if len(seen) >= 4:
            gate.set()
        return Reply(chunks=3, hold=gate if idx < 4 else None)

    s = SSEServer(behave).start()
    try:
        w = closed(requests=40)
        m = asyncio.run(measure_workload(w, s.url, None, timeout_s=20, progress=False))
    finally:
        s.stop()
    records = m.result.records
    assert len(records) == 40 and s.requests == 40 + 2  # and the two probes
    assert s.max_in_flight == 4  # the server saw 4 at once, never 5
    assert overlap(records) <= 4
    assert [r.plan.idx for r in records] == list(range(40))
    assert m.report["outcomes"]["success"] == sum(r.plan.measured for r in records)
    assert m.details["mode"] == {"kind": "closed", "concurrency": 4, "think_time_ms": None}
    # each slot sends its next request only after its last one ended: with 4 slots, the
    # k-th request (k >= 4) leaves after at least k - 3 requests ended
    ends = sorted(r.done for r in records)
    for k, rec in enumerate(records[4:], start=4):
        assert sum(e <= rec.dispatched for e in ends) >= k - 3, k


def test_same_requests_as_open_loop() -> None:
    # the n-th request's class and lengths are the same in both modes (one stream of draws)
    w = closed()
    it = requests_in_order(w)
    closed_plan = [next(it) for _ in range(30)]
    open_w = w.model_copy(update={"concurrency": None}).model_copy(
        update={"arrival": parse_workload({
            "duration_s": 30, "arrival": {"process": "poisson", "rate": 2},
            "classes": [{"name": "x", "share": 1, "lengths": {"pairs": [[1, 1]]}}]}).arrival})
    open_plan = schedule(open_w)[:30]
    assert len(open_plan) == 30
    for a, b in zip(closed_plan, open_plan, strict=True):
        assert (a.cls, a.input_tokens, a.output_tokens) == (b.cls, b.input_tokens,
                                                            b.output_tokens)


def test_think_time_spaces_a_slots_requests(server: SSEServer) -> None:
    # 2 slots, 250 ms think time, 1 s of load: each slot sends at most 1 + 1 / 0.25 = 5
    w = closed(concurrency=2, think_time_ms=250, duration_s=1.0)
    m = asyncio.run(measure_workload(w, server.url, None, timeout_s=10, progress=False))
    assert 2 <= len(m.result.records) <= 10
    assert m.details["mode"]["think_time_ms"] == 250


def test_duration_ends_a_closed_loop(server: SSEServer) -> None:
    w = closed(duration_s=0.6, warmup_s=0.1, cooldown_s=0.1)
    m = asyncio.run(measure_workload(w, server.url, None, timeout_s=10, progress=False))
    recs = m.result.records
    assert recs and all(r.plan.t < 0.6 for r in recs)
    # the window is [0.1, 0.5) of send times; rates divide by its 0.4 s
    inside = [r for r in recs if r.plan.measured]
    assert all(0.1 <= r.plan.t < 0.5 for r in inside)
    assert m.report["offered_rps"] == round(len(inside) / 0.4, 4)


@pytest.mark.parametrize("doc, field", [
    ({"concurrency": 2, "arrival": {"process": "poisson", "rate": 1}}, "exactly one of"),
    ({}, "exactly one of"),
    ({"concurrency": 0}, "concurrency"),
    ({"arrival": {"process": "poisson", "rate": 1}, "think_time_ms": 5}, "think_time_ms"),
])
def test_mode_validation(doc: dict[str, Any], field: str) -> None:
    with pytest.raises(WorkloadError, match=field):
        parse_workload({"duration_s": 5, **doc, "classes": [
            {"name": "a", "share": 1, "lengths": {"pairs": [[1, 1]]}}]})


def run_until(w: Workload, stop_at_idx: int | None) -> Any:
    """Run ``w`` against a server that sets the run's stop event when request
    ``stop_at_idx`` reaches it (None: stop is set before the run starts)."""
    async def go() -> Any:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def behave(idx: int, body: dict[str, Any]) -> Reply:
            if idx == stop_at_idx:
                loop.call_soon_threadsafe(stop.set)
            return Reply(chunks=2)

        s = SSEServer(behave).start()
        try:
            from loadtest.client import calibrate

            cal = await calibrate(s.url, None, w)
            if stop_at_idx is None:
                stop.set()
            return await measure_workload(w, s.url, None, timeout_s=10, progress=False,
                                          calibration=cal, stop=stop)
        finally:
            s.stop()

    return asyncio.run(go())


@pytest.mark.parametrize("mode", [{"concurrency": 2},
                                  {"arrival": {"process": "constant", "rate": 10}}])
def test_stopped_before_the_start_measures_nothing(mode: dict[str, Any]) -> None:
    w = parse_workload({"duration_s": 5, "model": "m", **mode, "classes": [
        {"name": "a", "share": 1, "lengths": {"pairs": [[4, 2]]}}]})
    m = run_until(w, None)
    r = m.report
    assert r["partial"] is True and sum(r["outcomes"].values()) == 0
    assert r["duration_s"] > 0 and r["offered_rps"] == 0 and r["goodput_rps"] == 0
    assert "nothing was measured" in r["notes"][0]


def test_a_stop_seen_late_still_says_nothing_was_measured() -> None:
    """A stop set before the start but seen 0.2 s in (a busy machine): the window is not
    before warmup_s, yet nothing ended, and the note says so (CI failed on this race)."""
    from loadtest.run import _partial
    from loadtest.runner import RunResult

    w = parse_workload({"duration_s": 5, "model": "m", "concurrency": 2, "classes": [
        {"name": "a", "share": 1, "lengths": {"pairs": [[4, 2]]}}]})
    _, notes = _partial(w, RunResult([], 0.0, 0.2, 0.0, interrupted_at=0.2))
    assert "interrupted 0.2 s" in notes[0] and "nothing was measured" in notes[0]


def test_a_stop_seen_within_a_millisecond_keeps_the_empty_window() -> None:
    """Seen 0.2 ms in (CI's case: the report's window, rounded to ms, read 0 s): the
    window is the empty one, 1 ms, and nothing was measured."""
    from loadtest.run import EMPTY_WINDOW_S, _partial
    from loadtest.runner import RunResult

    w = parse_workload({"duration_s": 5, "model": "m", "arrival": {"process": "constant",
                        "rate": 10}, "classes": [{"name": "a", "share": 1,
                                                  "lengths": {"pairs": [[4, 2]]}}]})
    eff, notes = _partial(w, RunResult([], 0.0, 0.0002, 0.0, interrupted_at=0.0002))
    assert eff.duration_s == EMPTY_WINDOW_S and "nothing was measured" in notes[0]


def test_stopped_during_warmup_counts_no_warmup_request() -> None:
    w = parse_workload({"duration_s": 30, "warmup_s": 20, "model": "m",
                        "arrival": {"process": "constant", "rate": 10},
                        "classes": [{"name": "a", "share": 1, "lengths": {"pairs": [[4, 2]]}}]})
    m = run_until(w, 3)
    assert m.report["partial"] is True
    assert m.result.records and not any(r.plan.measured for r in m.result.records)
    assert sum(m.report["outcomes"].values()) == 0
    assert "before warmup_s (20 s) ended" in m.report["notes"][0]


def test_stopped_closed_loop_keeps_what_ended() -> None:
    w = closed(duration_s=60)
    m = run_until(w, 12)
    assert m.report["partial"] is True
    recs = m.result.records
    assert recs and all(r.done and r.status == 200 for r in recs)
    assert sum(m.report["outcomes"].values()) == len(recs)  # no warmup: all measured


def test_a_request_cap_before_warmup_says_so() -> None:
    s = SSEServer(lambda idx, body: Reply(chunks=2)).start()
    try:
        w = closed(requests=6, warmup_s=20)
        m = asyncio.run(measure_workload(w, s.url, None, timeout_s=10, progress=False))
    finally:
        s.stop()
    assert len(m.result.records) == 6 and sum(m.report["outcomes"].values()) == 0
    assert any("request cap ended the run" in n for n in m.report["notes"])
