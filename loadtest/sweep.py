"""``--sweep``: the highest offered rate at which the joint SLO attainment holds (DistServe).

Capacity is not the rate where throughput peaks: it is the highest rate whose requests
still meet their SLOs often enough (``slo_attainment_goal``, 0.9 by default). The sweep
scales the workload's rate (same mix, same seed) and searches: double or halve from the
configured rate until the goal is bracketed, then bisect to within BRACKET. A probe the
client itself could not keep up with (unreliable) is run once more, and counts as a
failure if it is unreliable again: its numbers would describe the client, not the target.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from loadtest.run import Measurement
from loadtest.workload import Workload

BRACKET = 1.15  # stop bisecting when hi / lo is within this
MAX_PROBES = 8

Probe = Callable[[Workload, str], Awaitable[Measurement]]


class _Stopped(Exception):
    def __init__(self, m: Measurement) -> None:
        self.m = m


def point(m: Measurement) -> dict[str, Any]:
    r = m.report
    return {"offered_rps": r["offered_rps"], "achieved_rps": r["achieved_rps"],
            "goodput_rps": r["goodput_rps"], "slo_attainment": r["slo_attainment"],
            "unreliable": r["unreliable"], "outcomes": r["outcomes"]}


def passes(m: Measurement, goal: float) -> bool:
    att = m.report["slo_attainment"]
    return att is not None and att >= goal and not m.report["unreliable"]


async def find_capacity(w: Workload, probe: Probe, max_probes: int = MAX_PROBES,
                        stop: asyncio.Event | None = None,
                        ) -> tuple[float | None, Measurement, list[dict[str, Any]]]:
    """(capacity req/s or None, the measurement at capacity, the curve). ``stop`` set
    (Ctrl-C): no further probe; an interrupted probe is returned as it is, partial."""
    goal = w.slo_attainment_goal
    base = w.mean_rate()
    runs: dict[float, Measurement] = {}

    async def at(rate: float) -> bool:
        label = f"sweep {len(runs) + 1}/{max_probes} @ {rate:.3g} rps"
        m = await probe(w.scaled(rate / base), label)
        if stop is not None and stop.is_set():
            raise _Stopped(m)
        if m.report["unreliable"]:  # the client (or a busy machine) had a bad moment: once more
            m = await probe(w.scaled(rate / base), label + " (again: unreliable)")
            if stop is not None and stop.is_set():
                raise _Stopped(m)
        runs[rate] = m
        return passes(m, goal)

    lo: float | None = None
    hi: float | None = None
    rate = base
    try:
        while len(runs) < max_probes and (lo is None or hi is None):
            if await at(rate):
                lo = rate
                rate *= 2
            else:
                hi = rate
                rate /= 2
        while len(runs) < max_probes and lo is not None and hi is not None \
                and hi / lo > BRACKET:
            mid = (lo * hi) ** 0.5  # geometric: rates span orders of magnitude
            if await at(mid):
                lo = mid
            else:
                hi = mid
    except _Stopped as stopped:
        curve = [{"rate": round(r, 4), **point(runs[r])} for r in sorted(runs)]
        stopped.m.report["capacity_rps"] = None
        return None, stopped.m, curve
    curve = [{"rate": round(r, 4), **point(runs[r])} for r in sorted(runs)]
    if lo is None:
        return None, runs[min(runs)], curve
    return runs[lo].report["offered_rps"], runs[lo], curve
