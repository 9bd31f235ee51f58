"""``Pauses``: collector passes timed per generation, and event-loop stalls of any cause."""

from __future__ import annotations

import asyncio
import gc
import time

from telemetry.metrics import Registry
from telemetry.pauses import LONG_S, Pauses


def values(p: Pauses) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = Registry()
    r.collector(lambda: p.families("x_"))
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for m in r.collect() for s in m.samples}


async def test_collector_passes_are_timed_per_generation() -> None:
    p = Pauses()
    p.start()
    try:
        before = p.gens[2].passes
        gc.collect()  # a full pass: generation 2
        assert p.gens[2].passes == before + 1
        assert p.gens[2].seconds > 0 and p.gens[2].longest > 0
        v = values(p)
        assert v[("x_gc_passes_total", (("generation", "2"),))] == p.gens[2].passes
        assert v[("x_gc_pause_seconds_total", (("generation", "2"),))] == p.gens[2].seconds
    finally:
        await p.aclose()
    n = p.gens[2].passes
    gc.collect()  # uninstalled: no longer counted
    assert p.gens[2].passes == n


async def test_a_blocked_loop_is_counted_as_a_stall() -> None:
    p = Pauses()
    p.start()
    try:
        await asyncio.sleep(0)  # the watch is sleeping now
        deadline = time.monotonic() + 30
        while p.stalls == 0 and time.monotonic() < deadline:
            time.sleep(0.1)  # noqa: ASYNC251 (blocks the loop on purpose: the watch wakes >= 90 ms late)
            await asyncio.sleep(0.06)
        assert p.stalls >= 1 and p.longest_stall >= LONG_S
        v = values(p)
        assert v[("x_loop_stalls_total", ())] == p.stalls
        assert v[("x_loop_longest_stall_seconds", ())] == p.longest_stall
    finally:
        await p.aclose()
    assert p._task is None


def test_short_lateness_is_not_a_stall() -> None:
    p = Pauses()
    p.note_stall(LONG_S / 2)
    assert p.stalls == 0
    p.note_stall(LONG_S * 3)
    assert (p.stalls, p.stall_seconds, p.longest_stall) == (1, LONG_S * 3, LONG_S * 3)
