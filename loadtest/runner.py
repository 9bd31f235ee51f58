"""Drive one run: send the schedule open loop, watch the client, scrape the target.

The run's verdict on itself: if the client sent late (dispatch lag) or was busy (its own
CPU), the target saw less load than the schedule says, and the report says so
(``unreliable``) instead of passing off a client bottleneck as the target's capacity.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from loadtest.arrivals import Planned
from loadtest.client import Record, Target, endpoint, send_one
from loadtest.connections import Lender
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
    # Ctrl-C / SIGTERM: seconds after the start when the run was stopped; the records of
    # requests still in flight then (or never sent) are dropped, see run.py
    interrupted_at: float | None = None


def pool_size(w: Workload, timeout_s: float) -> int:
    """Connections for the load: peak rate x a generous time in flight, capped (closed
    loop: one per slot)."""
    if w.concurrency is not None:
        return w.concurrency + 1
    assert w.arrival is not None
    peak = max([w.mean_rate()] + [p.rate for p in (w.arrival.pieces or [])])
    if w.arrival.process == "diurnal":
        peak *= 1 + float(w.arrival.amplitude or 0)
    return int(min(2000, max(32, math.ceil(peak * min(timeout_s, 30.0) * 2))))


def lag_p99(records: list[Record]) -> float:
    lags = sorted(r.dispatched - r.scheduled for r in records if r.dispatched)
    if not lags:
        return 0.0
    return lags[min(len(lags) - 1, int(0.99 * len(lags)))]


def request_timeout(w: Workload, p: Planned, timeout_s: float) -> float:
    """The client's limit for one request: ``timeout_s``, or the class's deadline + 0.5 s."""
    c = w.class_named(p.cls)
    return timeout_s if c.deadline_ms is None else min(timeout_s, c.deadline_ms / 1000 + 0.5)


@dataclass(slots=True)
class Drive:
    """What every run needs, open or closed loop."""

    w: Workload
    target: Target
    body_for: Callable[[Planned], bytes]  # the encoded request body of a planned request
    keys: dict[str, str | None]
    scrape_urls: list[str] | None = None
    on_done: Callable[[Record], None] | None = None
    scrape_keys: Mapping[str, str] | None = None
    stop: asyncio.Event | None = None  # set (Ctrl-C, SIGTERM): stop and keep what finished


async def _stopped(stop: asyncio.Event | None, seconds: float) -> bool:
    """Sleep ``seconds``, or less if ``stop`` is set meanwhile; True when it was."""
    if stop is None:
        await asyncio.sleep(seconds)
        return False
    try:
        async with asyncio.timeout(max(0.0, seconds)):
            await stop.wait()
    except TimeoutError:
        return False
    return True


async def _drive(d: Drive, send: Callable[[Lender, float], Awaitable[list[Record]]],
                 ) -> RunResult:
    """Run ``send(lender, start)`` (which returns the records in send order) with the
    scraper beside it, and judge the client afterwards. The objects made before the run
    are frozen out of the garbage collector's scans for its length: its pauses then scale
    with what the run allocates, not with the whole process (they set the open loop's
    dispatch lag at high rates)."""
    lender = Lender(pool_size(d.w, d.target.timeout_s))
    scraper = Scraper(d.scrape_urls or [], keys=d.scrape_keys)
    gc.collect()
    gc.freeze()
    try:
        cpu0, t0 = time.process_time(), time.perf_counter()
        start = t0 + 0.05
        scrape_task = asyncio.create_task(scraper.run(start))
        try:
            records = await send(lender, start)
        finally:
            scraper.stop()
            await scrape_task
        now = time.perf_counter()
        wall = max(0.0, now - start)  # (a run stopped before its start: 0)
        cpu = (time.process_time() - cpu0) / max(now - t0, 1e-9)
    finally:
        gc.unfreeze()
        await lender.aclose()
    result = RunResult(records, start, wall, cpu, scraper.samples)
    if d.stop is not None and d.stop.is_set():
        result.interrupted_at = wall
    lag = lag_p99(records)
    if lag > LAG_P99_LIMIT_S:
        result.notes.append(f"unreliable: p99 dispatch lag {lag * 1000:.1f} ms "
                            f"> {LAG_P99_LIMIT_S * 1000:.0f} ms")
    if cpu > CLIENT_CPU_LIMIT:
        result.notes.append(f"unreliable: the client used {cpu:.0%} of a core "
                            f"(> {CLIENT_CPU_LIMIT:.0%})")
    return result


async def _finish(tasks: set[asyncio.Task[None]], stop: asyncio.Event | None) -> None:
    """Wait for the requests in flight (each is bounded); on ``stop``, cancel them."""
    pending = [t for t in tasks if not t.done()]
    if not pending:
        return
    together: asyncio.Future[Any] = asyncio.gather(*pending, return_exceptions=True)
    if stop is None:
        await together
        return
    stopper: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([together, stopper], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if not together.done():  # stopped: what is in flight is dropped
        together.cancel()
        await asyncio.gather(together, return_exceptions=True)


async def run_schedule(d: Drive, plan: list[Planned]) -> RunResult:
    """Open loop: send every planned request at its time; wait for them all (each is
    bounded), or until ``d.stop``."""
    w = d.w
    url = d.target.base_url + endpoint(w)
    # Encoded before the clock starts: the client's work must not delay the schedule.
    bodies = [d.body_for(p) for p in plan]
    records = [Record(plan=p) for p in plan]
    timeouts = [request_timeout(w, p, d.target.timeout_s) for p in plan]

    async def send(lender: Lender, start: float) -> list[Record]:
        tasks: set[asyncio.Task[None]] = set()

        async def one(i: int) -> None:
            async with lender.lend() as client:
                await send_one(client, url, d.keys.get(plan[i].cls), bodies[i], records[i],
                               timeouts[i])
            if d.on_done is not None:
                d.on_done(records[i])

        try:
            for i, p in enumerate(plan):
                due = start + p.t
                wait = due - time.perf_counter()
                if wait > BATCH_S and await _stopped(d.stop, wait):
                    break
                records[i].scheduled = due
                task = asyncio.create_task(one(i))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            else:
                end_of_schedule = start + w.duration_s
                await _stopped(d.stop, end_of_schedule - time.perf_counter())
            await _finish(tasks, d.stop)
        finally:
            for task in list(tasks):
                task.cancel()
        return records

    return await _drive(d, send)


async def run_closed(d: Drive, requests: Iterator[Planned]) -> RunResult:
    """Closed loop: ``w.concurrency`` slots, each sending its next request when its last
    one ended (plus the think time), until ``duration_s`` has passed or ``w.requests``
    were sent (or ``d.stop``). A request's ``t`` is when it left, after the start."""
    w = d.w
    assert w.concurrency is not None
    url = d.target.base_url + endpoint(w)
    think = w.think_time_ms / 1000
    limit = w.requests
    records: list[Record] = []
    w0, w1 = w.window()

    async def send(lender: Lender, start: float) -> list[Record]:
        end = start + w.duration_s

        async def slot(k: int) -> None:
            client = lender.dedicated()
            await _stopped(d.stop, start - time.perf_counter())
            while not (d.stop is not None and d.stop.is_set()):
                now = time.perf_counter()
                if now >= end or (limit is not None and len(records) >= limit):
                    return
                t = now - start
                p = dataclasses.replace(next(requests), t=t, measured=w0 <= t < w1)
                rec = Record(plan=p, scheduled=now)
                records.append(rec)
                await send_one(client, url, d.keys.get(p.cls), d.body_for(p), rec,
                               request_timeout(w, p, d.target.timeout_s))
                if d.on_done is not None:
                    d.on_done(rec)
                if think and await _stopped(d.stop, think):
                    return

        tasks = {asyncio.create_task(slot(k)) for k in range(w.concurrency or 1)}
        try:
            await _finish(tasks, d.stop)
        finally:
            for task in tasks:
                task.cancel()
        return records

    return await _drive(d, send)
