"""Drive one run: send the schedule open loop, watch the client, scrape the target.

The run's verdict on itself: if the client sent late (dispatch lag) or was busy (its own
CPU), the target saw less load than the schedule says, and the report says so
(``unreliable``) instead of passing off a client bottleneck as the target's capacity.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import httpx

from loadtest.arrivals import Planned
from loadtest.client import Record, Target, endpoint, request_body, send_one
from loadtest.prompts import PromptBook
from loadtest.scrape import Sample, Scraper
from loadtest.workload import Workload

LAG_P99_LIMIT_S = 0.025  # a p99 dispatch lag past this: the client did not keep the schedule
CLIENT_CPU_LIMIT = 0.85  # share of one core the client may use before it becomes the limit
BATCH_S = 0.0005  # requests due within this go out together (timers tick in ~1 ms)


@dataclass(slots=True)
class RunResult:
    records: list[Record]
    start: float  # perf_counter at schedule time 0
    wall_s: float
    client_cpu: float  # share of one core used by this process during the run
    scraped: list[Sample] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def pool_size(w: Workload, timeout_s: float) -> int:
    """Connections for the load: peak rate x a generous time in flight, capped."""
    peak = max([w.mean_rate()] + [p.rate for p in (w.arrival.pieces or [])])
    if w.arrival.process == "diurnal":
        peak *= 1 + float(w.arrival.amplitude or 0)
    return int(min(2000, max(32, math.ceil(peak * min(timeout_s, 30.0) * 2))))


def lag_p99(records: list[Record]) -> float:
    lags = sorted(r.dispatched - r.scheduled for r in records if r.dispatched)
    if not lags:
        return 0.0
    return lags[min(len(lags) - 1, int(0.99 * len(lags)))]


async def run_schedule(w: Workload, plan: list[Planned], target: Target, prompts: PromptBook,
                       keys: dict[str, str | None], scrape_urls: list[str] | None = None,
                       on_done: Callable[[Record], None] | None = None,
                       scrape_keys: Mapping[str, str] | None = None) -> RunResult:
    """Send every planned request at its time; wait for them all (each is bounded).
    ``scrape_keys``: the bearer key of a scraped base URL that needs one."""
    url = target.base_url + endpoint(w)
    size = pool_size(w, target.timeout_s)
    limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
    # Encoded before the clock starts: the client's work must not delay the schedule.
    bodies = [json.dumps(request_body(w, p, prompts, target)).encode() for p in plan]
    records = [Record(plan=p) for p in plan]
    timeouts = []
    for p in plan:
        c = w.class_named(p.cls)
        t = target.timeout_s if c.deadline_ms is None else min(target.timeout_s,
                                                                 c.deadline_ms / 1000 + 0.5)
        timeouts.append(t)
    scraper = Scraper(scrape_urls or [], keys=scrape_keys)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None)) as client:
        tasks: set[asyncio.Task[None]] = set()

        async def one(i: int) -> None:
            await send_one(client, url, keys.get(plan[i].cls), bodies[i], records[i],
                           timeouts[i])
            if on_done is not None:
                on_done(records[i])

        cpu0 = time.process_time()
        start = time.perf_counter() + 0.05
        scrape_task = asyncio.create_task(scraper.run(start))
        try:
            for i, p in enumerate(plan):
                due = start + p.t
                wait = due - time.perf_counter()
                if wait > BATCH_S:
                    await asyncio.sleep(wait)
                records[i].scheduled = due
                task = asyncio.create_task(one(i))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            end_of_schedule = start + w.duration_s
            if end_of_schedule > time.perf_counter():
                await asyncio.sleep(end_of_schedule - time.perf_counter())
            while tasks:
                await asyncio.gather(*list(tasks))
        finally:
            for task in list(tasks):
                task.cancel()
            scraper.stop()
            await scrape_task
        wall = time.perf_counter() - start
        cpu = (time.process_time() - cpu0) / max(wall, 1e-9)
    result = RunResult(records, start, wall, cpu, scraper.samples)
    lag = lag_p99(records)
    if lag > LAG_P99_LIMIT_S:
        result.notes.append(f"unreliable: p99 dispatch lag {lag * 1000:.1f} ms "
                            f"> {LAG_P99_LIMIT_S * 1000:.0f} ms")
    if cpu > CLIENT_CPU_LIMIT:
        result.notes.append(f"unreliable: the client used {cpu:.0%} of a core "
                            f"(> {CLIENT_CPU_LIMIT:.0%})")
    return result
