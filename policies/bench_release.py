"""Cross-replica dispatch delay after a release, with and without release events.

    python -m policies.bench_release [--samples 300]

Starts its own ``redis-server`` (a free 127.0.0.1 port, no persistence; stopped by PID) and
plays two replicas, each a process with its own event loop and Redis client. Replica A holds an
upstream's only slot (``cap_seqs`` 1) and releases it at a random moment (5-45 ms after B
started waiting, so the release falls at a random phase of B's poll); replica B waits for
the slot as a dispatch queue's pump does (clear the wake event, ask the gate, wait for the
event or the poll period). A sample is the time B is granted minus the time A sent its
release (``time.monotonic``: one clock for the machine's processes): never negative, as the
release cannot reach B before it left A, though it counts A's own path to Redis (the time A's
call returned is no better a mark: A's process may be scheduled late to read the answer, by
more than B needs to be granted). Rounds alternate between

    poll     no release events: B re-tries the gate every POLL_S (20 ms), as before
    events   B's ``ReleaseEvents`` subscriber wakes it; the poll is the fallback (0.25 s)

so both see the same Redis, machine and moment. Printed: p50 / p99 / max of the delay and
B's gate calls per wait. B's wait loop is modelled here rather than imported
(``gateway.queue`` is out of ``policies``' reach): it is ``DispatchQueue._run``'s loop for
one waiter, with the same periods.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from redis.asyncio import Redis

from policies.capacity import RedisGate
from policies.redis_child import redis_child
from policies.release_events import ReleaseEvents

POLL_S = 0.02  # gateway.queue.POLL_S: without events
FALLBACK_POLL_S = 0.25  # gateway.queue.FALLBACK_POLL_S: with events heard
UP = "m"


class ReplicaA:
    """Holds the slot and releases it on request: a process of its own (a replica), told
    what to do over a pipe. Times are ``time.monotonic()``: CLOCK_MONOTONIC, one clock for
    every process of the machine."""

    def __init__(self, url: str, prefix: str) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_replica_a, args=(url, prefix, child), daemon=True)
        self._proc.start()

    async def ask(self, *cmd: object) -> float:
        """Send a command; its answer (a time, or 0.0), received off the event loop."""
        self._conn.send(cmd)
        answer = await asyncio.get_running_loop().run_in_executor(None, self._conn.recv)
        try:
            return float(answer)  # a str is replica A's complaint
        except ValueError:
            raise RuntimeError(f"replica A: {answer}") from None

    def close(self) -> None:
        self._conn.send(("stop",))
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


def _replica_a(url: str, prefix: str, conn: Connection) -> None:
    async def serve() -> None:
        client = Redis.from_url(url)
        gate = RedisGate(client, key_prefix=prefix)
        loop = asyncio.get_running_loop()
        try:
            while True:
                cmd = await loop.run_in_executor(None, conn.recv)
                if cmd[0] == "hold":
                    ok = await gate.acquire(UP, cmd[1], 1, None, 1, 30)
                    conn.send(0.0 if ok else "could not take the free slot")
                elif cmd[0] == "release_after":
                    await asyncio.sleep(cmd[2])
                    sent = time.monotonic()
                    ok = await gate.release(UP, cmd[1])
                    conn.send(sent if ok else "its slot was gone")
                else:
                    return
        finally:
            await client.aclose()

    asyncio.run(serve())


@dataclass
class ReplicaB:
    gate: RedisGate
    events: ReleaseEvents | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    calls: int = 0

    async def wait_for_slot(self, rid: str, listen: bool, waiting: asyncio.Event) -> float:
        """The pump's loop for one waiter; returns the time it was granted."""
        while True:
            self.wake.clear()  # before the gate call, as DispatchQueue._run does
            self.calls += 1
            if await self.gate.acquire(UP, rid, 1, None, 1, 30):
                return time.monotonic()
            waiting.set()
            hears = listen and self.events is not None and self.events.hears(UP)
            try:
                async with asyncio.timeout(FALLBACK_POLL_S if hears else POLL_S):
                    await self.wake.wait()
            except TimeoutError:
                pass


def woken_if(b: ReplicaB, listening: Callable[[], bool]) -> Callable[[], None]:
    def wake() -> None:
        if listening():
            b.wake.set()
    return wake


async def bench(url: str, samples: int, seed: int) -> dict[str, tuple[list[float], int]]:
    rng = random.Random(seed)
    prefix = f"bench{rng.randrange(1 << 30)}"
    a = ReplicaA(url, prefix)
    client_b = Redis.from_url(url)
    b = ReplicaB(RedisGate(client_b, key_prefix=prefix))
    mode = {"listen": False}
    b.events = ReleaseEvents(client_b, {UP: b.gate.channel(UP)},
                             {UP: woken_if(b, lambda: mode["listen"])})
    b.events.start()
    out: dict[str, tuple[list[float], int]] = {"poll": ([], 0), "events": ([], 0)}
    try:
        deadline = time.monotonic() + 10
        while not b.events.hears(UP):
            if time.monotonic() > deadline:
                raise SystemExit("replica B did not subscribe")
            await asyncio.sleep(0.01)
        for i in range(2 * samples):
            name = "events" if i % 2 else "poll"
            mode["listen"] = name == "events"
            await a.ask("hold", f"a{i}")
            calls = b.calls
            waiting = asyncio.Event()
            waiter = asyncio.ensure_future(b.wait_for_slot(f"b{i}", mode["listen"], waiting))
            await waiting.wait()
            delay = rng.uniform(0.005, 0.045)
            released = asyncio.ensure_future(a.ask("release_after", f"a{i}", delay))
            granted = await waiter
            delays, n = out[name]
            delays.append(granted - await released)
            out[name] = (delays, n + b.calls - calls)
            await b.gate.release(UP, f"b{i}")
    finally:
        await b.events.aclose()
        await client_b.aclose()
        a.close()
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=300, help="per mode (at least 200)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    with redis_child("bench-release-") as server:
        out = asyncio.run(bench(server.url, args.samples, args.seed))
    print(f"cross-replica dispatch delay after a release (B granted - A sent its "
          f"release), {args.samples} samples each, redis-server on 127.0.0.1")
    print(f"{'':9} {'min ms':>7} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'mean ms':>8} "
          f"{'gate calls/wait':>16}")
    for name, label in (("poll", f"poll {POLL_S * 1000:.0f}ms"), ("events", "events")):
        d, calls = out[name]
        print(f"{label:9} {min(d) * 1e3:7.2f} {pct(d, 0.5) * 1e3:7.2f} "
              f"{pct(d, 0.99) * 1e3:7.2f} {max(d) * 1e3:7.2f} {statistics.fmean(d) * 1e3:8.2f} "
              f"{calls / len(d):16.2f}")
    p, e = out["poll"][0], out["events"][0]
    print(f"p50 ratio poll/events: {pct(p, 0.5) / pct(e, 0.5):.1f}x, "
          f"p99: {pct(p, 0.99) / pct(e, 0.99):.1f}x")


if __name__ == "__main__":
    main()
