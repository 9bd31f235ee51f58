"""Long work off the event loop: a bounded pool of threads or processes, shared fairly by
tenants.

Two kinds of work must not run on a server's event loop, and both are here:

- **Tokenizing long prompts** (``TokenizePool``, threads): a short prompt is tokenized
  where it is (``inline_chars``: below it, a thread hop would cost more than the work); a
  long one runs in a thread, which really runs in parallel with the event loop
  (``modelfiles.Tokenizer.encode_long`` releases the GIL).
- **Parsing large JSON bodies** (``parse_pool``, processes): a parser builds Python
  objects, so it holds the GIL; a 3.8 MB body of 120k tiny messages takes ~40 ms to parse
  and ~7 ms to free, and a thread would stall the loop all the same. A worker process
  parses it, applies the O(1) bounds that refuse most such bodies (``parse_body_job``),
  and sends back either the error or the object; the loop only waits
  (``protocol.large_bodies``).

A pool is the only place such work happens, so it bounds it:

    workers       threads (processes) working at once
    per_tenant    one tenant's jobs running or waiting; one more: 429
    max_waiting   jobs waiting for a worker, all tenants together; one more: 503

Both refusals carry Retry-After from the pool's state: a tenant at its share waits about
the rest of its oldest running job; a full pool about a job's average time per worker.

Fairness (``FairSlots``, a pure state machine): a waiting job sits in its tenant's FIFO,
and a freed worker takes the head of the next tenant in a round-robin of the tenants that
have jobs waiting. So once a job is at the head of its tenant's FIFO, at most one job of
each other waiting tenant starts before it, however many the others have queued; and
``per_tenant`` keeps any one tenant from filling the queue. A job counts against its
tenant until its worker is done, even if the request that wanted it has gone: cancelling
cannot be used to pile up work.

A job returns its result and its size (characters tokenized, bytes parsed); after
``trim_chars`` or more, its worker hands the freed memory back to the system
(``protocol.memory``): glibc keeps the freed heap pages of a large tokenization otherwise
(a 3.8 MB prompt's encoding is ~350 MiB). The job measures its own size, in the worker:
deciding it on the event loop would mean walking the request there. A process worker
that dies (killed, out of memory) fails its jobs with a 503; the next job starts a new one.

What the event loop does for ``is_long`` is O(1) per JSON node and stops early: it adds up
string lengths and container sizes, with exact-type checks, until it passes
``inline_chars``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import multiprocessing
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .errors import RateLimited, ServiceUnavailable
from .memory import release_memory

T = TypeVar("T")
J = TypeVar("J", bound=Hashable)
MIN_RETRY_S = 0.05
_EWMA = 0.2  # weight of the newest job's duration in the average


@dataclass(slots=True, frozen=True)
class OffloadSettings:
    workers: int = 2
    per_tenant: int = 8
    max_waiting: int = 64
    inline_chars: int = 8192  # ~2 ms of tokenizing: less is done on the event loop
    trim_chars: int = 1 << 20  # after a job this large, give freed memory back

    def __post_init__(self) -> None:
        if self.workers < 1 or self.per_tenant < 1 or self.max_waiting < 0 \
                or self.inline_chars < 0 or self.trim_chars < 0:
            raise ValueError("tokenize pool: workers and per_tenant must be >= 1, "
                             "max_waiting, inline_chars and trim_chars >= 0")


class Verdict(enum.Enum):
    RUN = "run"  # a thread is free: start now
    WAIT = "wait"  # queued in the tenant's FIFO
    TENANT_FULL = "tenant_full"  # the tenant has per_tenant jobs: 429
    POOL_FULL = "pool_full"  # every thread busy and max_waiting jobs queued: 503


class FairSlots(Generic[J]):
    """Which job runs next. Pure: no threads, no clock; jobs are opaque tokens.

    Invariants (``check_invariants``): running <= workers; a job waits only while every
    thread is busy; each tenant's active count = its running + waiting jobs <= per_tenant;
    a tenant is in the rotation iff it has a waiting job.
    """

    def __init__(self, workers: int, per_tenant: int, max_waiting: int) -> None:
        self.workers = workers
        self.per_tenant = per_tenant
        self.max_waiting = max_waiting
        self.running = 0
        self.waiting = 0
        self.active: dict[str, int] = {}  # running + waiting, per tenant with any
        self.running_of: dict[str, int] = {}
        self._queues: OrderedDict[str, deque[J]] = OrderedDict()  # the rotation

    def admit(self, tenant: str, job: J) -> Verdict:
        if self.active.get(tenant, 0) >= self.per_tenant:
            return Verdict.TENANT_FULL
        if self.running < self.workers:
            self._start(tenant)
            return Verdict.RUN
        if self.waiting >= self.max_waiting:
            return Verdict.POOL_FULL
        self.active[tenant] = self.active.get(tenant, 0) + 1
        self._queues.setdefault(tenant, deque()).append(job)
        self.waiting += 1
        return Verdict.WAIT

    def finish(self, tenant: str) -> tuple[str, J] | None:
        """A running job of ``tenant`` is done; returns (tenant, job) started in its place."""
        self.running -= 1
        self.running_of[tenant] -= 1
        if not self.running_of[tenant]:
            del self.running_of[tenant]
        self._drop(tenant)
        if not self._queues:
            return None
        if tenant in self._queues:  # the tenant that just ran goes behind the others
            self._queues.move_to_end(tenant)
        nxt, queue = next(iter(self._queues.items()))
        job = queue.popleft()
        self.waiting -= 1
        if queue:
            self._queues.move_to_end(nxt)  # round-robin: the next tenant goes first
        else:
            del self._queues[nxt]
        self.active[nxt] -= 1  # _start counts it again, as running
        self._start(nxt)
        return nxt, job

    def withdraw(self, tenant: str, job: J) -> bool:
        """A waiting job left before it started; False if it was not waiting."""
        queue = self._queues.get(tenant)
        if queue is None or job not in queue:
            return False
        queue.remove(job)
        if not queue:
            del self._queues[tenant]
        self.waiting -= 1
        self._drop(tenant)
        return True

    def _start(self, tenant: str) -> None:
        self.running += 1
        self.running_of[tenant] = self.running_of.get(tenant, 0) + 1
        self.active[tenant] = self.active.get(tenant, 0) + 1

    def _drop(self, tenant: str) -> None:
        self.active[tenant] -= 1
        if not self.active[tenant]:
            del self.active[tenant]

    def check_invariants(self) -> None:
        waiting_of = {t: len(q) for t, q in self._queues.items()}
        if not 0 <= self.running <= self.workers:
            raise AssertionError(f"running {self.running} outside [0, {self.workers}]")
        if self.waiting != sum(waiting_of.values()) or self.waiting > self.max_waiting:
            raise AssertionError(f"waiting {self.waiting} != {waiting_of}")
        if self.waiting and self.running < self.workers:
            raise AssertionError("a job waits while a thread is free")
        if self.running != sum(self.running_of.values()):
            raise AssertionError(f"running {self.running} != {self.running_of}")
        if any(not q for q in self._queues.values()):
            raise AssertionError("an empty queue in the rotation")
        for t in set(self.active) | set(self.running_of) | set(waiting_of):
            n = self.running_of.get(t, 0) + waiting_of.get(t, 0)
            if self.active.get(t, 0) != n or not 0 < n <= self.per_tenant:
                raise AssertionError(f"tenant {t!r}: active {self.active.get(t)} != {n}")


@dataclass(slots=True, frozen=True)
class PoolSnapshot:
    running: int
    waiting: int
    tenants: int  # with a job running or waiting
    refused_tenant: int  # 429s since start
    refused_full: int  # 503s since start


@dataclass(slots=True, frozen=True)
class Wording:
    """A pool's name (its threads') and how its refusals read: ``tenant`` and ``busy``
    complete "too many ... at once" and "the server is ..."; the codes are the errors'
    ``code``."""

    name: str
    tenant: str
    tenant_code: str
    busy: str
    busy_code: str


TOKENIZE = Wording("tokenize", "prompts of yours are being tokenized", "tokenize_concurrency",
                   "tokenizing too many long prompts", "tokenizer_busy")



class _Job:
    __slots__ = ("started",)

    def __init__(self, started: asyncio.Future[None]) -> None:
        self.started = started


class WorkPool:
    """A pool (see the module): threads by default, processes with ``processes=True`` (then a
    job and its result must pickle). Callers tokenize inline unless ``is_long``, else
    ``run``."""

    def __init__(self, settings: OffloadSettings | None = None,
                 clock: Callable[[], float] = time.monotonic, *,
                 processes: bool = False, wording: Wording = TOKENIZE) -> None:
        self.settings = s = settings or OffloadSettings()
        self._slots: FairSlots[_Job] = FairSlots(s.workers, s.per_tenant, s.max_waiting)
        self._clock = clock
        self._processes = processes
        self._wording = wording
        self._executor: Executor | None = None
        self._avg_s = MIN_RETRY_S  # running average of a pooled job's duration
        self._started: dict[str, deque[float]] = {}  # per tenant, its running jobs' starts
        self._refused_tenant = 0
        self._refused_full = 0

    def is_long(self, *values: Any) -> bool:
        """Whether tokenizing these JSON values is long work: for the pool, not the loop."""
        return json_size_over(values, self.settings.inline_chars)

    async def run(self, tenant: str, job: Callable[[], tuple[T, int]]) -> T:
        """``job()`` in a worker of the pool, once the tenant's turn comes; it returns its
        result and its size (``trim_chars`` or more: the worker gives memory back after
        it). Raises ``RateLimited`` (429) or ``ServiceUnavailable``
        (503) when the pool refuses it."""
        loop = asyncio.get_running_loop()
        waiter = _Job(loop.create_future())
        verdict = self._slots.admit(tenant, waiter)
        if verdict is Verdict.TENANT_FULL:
            self._refused_tenant += 1
            w = self._wording
            raise RateLimited(f"too many {w.tenant} at once (at most "
                              f"{self.settings.per_tenant}); retry when one is done",
                              code=w.tenant_code, retry_after_s=self._tenant_wait(tenant))
        if verdict is Verdict.POOL_FULL:
            self._refused_full += 1
            raise ServiceUnavailable(f"the server is {self._wording.busy}; retry shortly",
                                     code=self._wording.busy_code,
                                     retry_after_s=max(MIN_RETRY_S,
                                                       self._avg_s / self.settings.workers))
        if verdict is Verdict.WAIT:
            try:
                await waiter.started
            except asyncio.CancelledError:
                if not self._slots.withdraw(tenant, waiter) and not waiter.started.cancelled():
                    self._done(tenant, None)  # it was started for us: hand the thread on
                raise
        return await self._submit(loop, tenant, job)

    async def _submit(self, loop: asyncio.AbstractEventLoop, tenant: str,
                      job: Callable[[], tuple[T, int]]) -> T:
        executor = self._ensure_executor()
        start = self._clock()
        self._started.setdefault(tenant, deque()).append(start)
        try:
            future = executor.submit(_work, job, self.settings.trim_chars)
        except BrokenProcessPool:
            future = None
        if future is None:
            self._done(tenant, start)
            raise self._broken()
        # the slot is freed when the worker is done, whether or not anyone still waits
        future.add_done_callback(lambda _: _call_soon(loop, self._done, tenant, start))
        try:
            return await asyncio.wrap_future(future)
        except BrokenProcessPool:
            raise self._broken() from None

    def _ensure_executor(self) -> Executor:
        if self._executor is None:
            workers = self.settings.workers
            if self._processes:  # spawned: a fork would copy the server's threads and heap
                self._executor = ProcessPoolExecutor(
                    workers, mp_context=multiprocessing.get_context("spawn"),
                    initializer=_watch_parent, initargs=(os.getpid(),))
            else:
                self._executor = ThreadPoolExecutor(workers, thread_name_prefix=f"sluice-{self._wording.name}")
        return self._executor

    def _broken(self) -> ServiceUnavailable:
        """A worker process died: its jobs fail, and the next job starts a new pool."""
        self._refused_full += 1
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            _stop_workers(self._executor)
            self._executor = None
        return ServiceUnavailable("a worker process of the server stopped; retry",
                                  code=self._wording.busy_code, retry_after_s=1.0)

    def warm(self, job: Callable[[], object] | None = None) -> None:
        """Start the workers now rather than on the first job: a process takes ~0.3 s to
        start, and ~0.15 s more to import the module its jobs live in, which running
        ``job`` (a do-nothing function of that module) makes it do."""
        if self._processes:
            executor = self._ensure_executor()
            for _ in range(self.settings.workers):
                executor.submit(job or _warm)

    def _done(self, tenant: str, start: float | None) -> None:
        if start is not None:
            starts = self._started[tenant]
            starts.remove(start)
            if not starts:
                del self._started[tenant]
            took = self._clock() - start
            self._avg_s = (1 - _EWMA) * self._avg_s + _EWMA * took
        nxt = self._slots.finish(tenant)
        while nxt is not None:
            t, job = nxt
            if not job.started.cancelled():
                job.started.set_result(None)
                return
            nxt = self._slots.finish(t)  # its request left as it was chosen: skip it

    def _tenant_wait(self, tenant: str) -> float:
        starts = self._started.get(tenant)
        if not starts:  # all its jobs wait: about one round of the pool
            rounds = 1 + self._slots.waiting // self.settings.workers
            return max(MIN_RETRY_S, rounds * self._avg_s)
        return max(MIN_RETRY_S, self._avg_s - (self._clock() - starts[0]))

    def snapshot(self) -> PoolSnapshot:
        s = self._slots
        return PoolSnapshot(s.running, s.waiting, len(s.active), self._refused_tenant,
                            self._refused_full)

    def close(self) -> None:
        """Stop the workers: threads once their jobs are done, processes now (nobody waits
        for those results)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            if self._processes:
                _stop_workers(self._executor)
            self._executor = None


TokenizePool = WorkPool  # threads, tokenize wording: the default


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: the server has stopped, nothing to free
        pass


def _stop_workers(executor: Executor) -> None:
    """Terminate a process pool's workers. Its own shutdown asks them to leave through its
    manager thread, and CPython 3.11's manager thread can die on a worker that died while
    another was starting ("dictionary changed size during iteration"), leaving a worker
    that nobody stops; multiprocessing then waits for it when the server exits. The
    executor keeps its processes in ``_processes`` (private, the same from 3.8 to 3.13)."""
    procs = getattr(executor, "_processes", None) or {}
    for _ in range(3):  # the manager thread may change the dict meanwhile
        try:
            workers = list(procs.values())
            break
        except RuntimeError:
            continue
    else:
        return
    for proc in workers:
        with contextlib.suppress(Exception):
            proc.terminate()


def _watch_parent(parent: int) -> None:
    """In a worker process: leave when the server is gone (killed with SIGKILL, say), which
    a worker waiting for its next job would not notice otherwise (it holds both ends of
    its queue's pipe)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="sluice-parent-watch", daemon=True).start()


def _warm() -> None:
    """Run in a new worker process: importing this module there is the point."""


def _work(job: Callable[[], tuple[T, int]], trim_chars: int) -> T:
    result, chars = job()
    if chars >= trim_chars:
        release_memory()
    return result


def json_size_over(value: Any, limit: int) -> bool:
    """Whether a JSON value is larger than ``limit``: its strings' characters plus one per
    container element (the work a tokenizer could have with it, roughly). O(1) per node,
    exact JSON types only (what a parsed body holds; a tuple groups the values asked
    about); it stops as soon as it is over, before stacking a container's elements, and is
    iterative, so nesting costs no stack."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is str:
            total += len(item)
        elif kind is dict or kind is list or kind is tuple:
            total += len(item)
            if total > limit:
                return True
            if kind is dict:
                stack.extend(item.keys())
                stack.extend(item.values())
            else:
                stack.extend(item)
        if total > limit:
            return True
    return False
