"""What stops a server's event loop: the garbage collector's passes and any other stall.

A p99 spike in an otherwise quiet run is a pause that held every request in flight: a full
pass of the cyclic collector, a burst of store calls, a blocking call on the loop, or the
process not being scheduled. ``Pauses`` counts the first and the last of these, so that a
bench can read them before and after a segment and say which one a bad segment had:

* the collector: ``gc.callbacks`` time each pass (``perf_counter`` at start and stop), per
  generation; passes of ``LONG_S`` or more are counted apart;
* the loop: a task sleeps ``TICK_S`` and measures how late it wakes; a wake-up ``LONG_S``
  or more late is a stall (whatever its cause; a collector pass inside it shows in both).

The callback only adds to plain numbers (it runs inside an allocation, where taking a lock
that the interrupted code may hold would deadlock); scrape time turns them into families.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from telemetry.metrics import Family

LONG_S = 0.005  # a pause this long or longer is counted apart (a p99 of a few ms feels it)
# How often the loop checks on itself. A stall is seen from the first tick that falls in it
# (what it measures is how late that tick ran), so one of 1.5 ticks or more is always counted.
TICK_S = 0.01


@dataclass(slots=True)
class _Gen:
    passes: int = 0
    seconds: float = 0.0
    long: int = 0
    longest: float = 0.0


@dataclass
class Pauses:
    """Collector passes and loop stalls of this process, for ``/metrics``."""

    gens: list[_Gen] = field(default_factory=lambda: [_Gen(), _Gen(), _Gen()])
    stalls: int = 0
    stall_seconds: float = 0.0
    longest_stall: float = 0.0
    _started: float = 0.0
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Install the collector callback and the loop watch (on the running loop)."""
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def aclose(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        g = self.gens[min(int(info.get("generation", 0)), 2)]
        g.passes += 1
        g.seconds += took
        if took >= LONG_S:
            g.long += 1
        g.longest = max(g.longest, took)

    def note_stall(self, late_s: float) -> None:
        if late_s >= LONG_S:
            self.stalls += 1
            self.stall_seconds += late_s
            self.longest_stall = max(self.longest_stall, late_s)

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + TICK_S
            await asyncio.sleep(TICK_S)
            self.note_stall(loop.time() - due)

    def families(self, prefix: str) -> Iterator[Family]:
        gens = list(enumerate(self.gens))
        yield _labelled(Family(prefix + "gc_passes_total", "counter",
                               "Passes of the cyclic garbage collector, by generation."),
                        ((g.passes, i) for i, g in gens))
        yield _labelled(Family(prefix + "gc_pause_seconds_total", "counter",
                               "Time the loop stood still in collector passes."),
                        ((g.seconds, i) for i, g in gens))
        yield _labelled(Family(prefix + "gc_long_pauses_total", "counter",
                               f"Collector passes of {LONG_S * 1000:g} ms or more."),
                        ((g.long, i) for i, g in gens))
        yield _labelled(Family(prefix + "gc_longest_pause_seconds", "gauge",
                               "The longest collector pass since the start."),
                        ((g.longest, i) for i, g in gens))
        yield Family(prefix + "loop_stalls_total", "counter",
                     f"Times the event loop woke {LONG_S * 1000:g} ms or more late "
                     "(any cause).").add(self.stalls)
        yield Family(prefix + "loop_stall_seconds_total", "counter",
                     "Lateness summed over those stalls.").add(self.stall_seconds)
        yield Family(prefix + "loop_longest_stall_seconds", "gauge",
                     "The longest stall since the start.").add(self.longest_stall)


def _labelled(fam: Family, samples: Iterator[tuple[float, int]]) -> Family:
    for value, gen in samples:
        fam.add(value, generation=str(gen))
    return fam
