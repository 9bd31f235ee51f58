"""The capacity search, against a fake target whose attainment falls past a known rate."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from loadtest.sweep import BRACKET, find_capacity
from loadtest.workload import Workload, parse_workload

TRUE_CAPACITY = 7.3


def workload() -> Workload:
    return parse_workload({"duration_s": 10, "arrival": {"process": "poisson", "rate": 2},
                           "classes": [{"name": "a", "share": 1,
                                        "lengths": {"pairs": [[8, 4]]}}]})


def fake(unreliable_once_at: float | None = None) -> tuple[Any, list[float]]:
    seen: list[float] = []

    async def probe(w: Workload, label: str) -> Any:
        rate = w.mean_rate()
        seen.append(rate)
        flaky = unreliable_once_at is not None and abs(rate - unreliable_once_at) < 1e-9 \
            and seen.count(rate) == 1
        ok = rate <= TRUE_CAPACITY
        return SimpleNamespace(report={
            "offered_rps": rate, "achieved_rps": rate, "goodput_rps": rate if ok else 1.0,
            "slo_attainment": 0.95 if ok else 0.5, "unreliable": flaky,
            "outcomes": {}})

    return probe, seen


def test_brackets_then_bisects() -> None:
    probe, seen = fake()
    capacity, m, curve = asyncio.run(find_capacity(workload(), probe, max_probes=10))
    assert seen[:3] == [2.0, 4.0, 8.0]  # doubles from the configured rate until it fails
    assert capacity is not None and capacity <= TRUE_CAPACITY < capacity * BRACKET
    assert m.report["offered_rps"] == capacity
    assert [p["offered_rps"] for p in curve] == sorted(seen)


def test_an_unreliable_probe_is_repeated() -> None:
    probe, seen = fake(unreliable_once_at=4.0)
    capacity, _, _ = asyncio.run(find_capacity(workload(), probe, max_probes=10))
    assert seen.count(4.0) == 2 and capacity is not None and capacity > 4.0


def test_no_rate_meets_the_goal() -> None:
    async def probe(w: Workload, label: str) -> Any:
        return SimpleNamespace(report={"offered_rps": w.mean_rate(), "achieved_rps": 0,
                                       "goodput_rps": 0, "slo_attainment": 0.1,
                                       "unreliable": False, "outcomes": {}})

    capacity, _, curve = asyncio.run(find_capacity(workload(), probe, max_probes=4))
    assert capacity is None and len(curve) == 4


def test_an_interrupt_ends_the_sweep_with_the_partial_probe() -> None:
    # the stop comes during the repeat of an unreliable probe at 4 rps: no further probe
    # starts, and that (partial) probe is what the sweep returns
    stop = asyncio.Event()
    inner, seen = fake(unreliable_once_at=4.0)

    async def probe(w: Workload, label: str) -> Any:
        m = await inner(w, label)
        if len(seen) == 3:  # 2.0, 4.0 (unreliable), 4.0 again
            stop.set()
            m.report["partial"] = True
        return m

    capacity, m, curve = asyncio.run(find_capacity(workload(), probe, max_probes=10,
                                                   stop=stop))
    assert seen == [2.0, 4.0, 4.0] and capacity is None
    assert m.report["partial"] is True and m.report["offered_rps"] == 4.0
    assert [p["offered_rps"] for p in curve] == [2.0]  # the finished probes only
