"""The dispatch queue of one upstream, in asyncio: waiters and the pump.

A request waits here (after its quota reservation) until the upstream has room for it: the
capacity gate (``policies.capacity``) grants a slot while the upstream's in-flight
worst-case tokens stay within its KV token capacity × overcommit and its in-flight
sequences within its max. With room and nobody waiting, a request passes straight through.
Who goes next, who is shed and the predicted wait are ``policies.fair_queue``'s (order,
fair share, aging, reserve, drain estimate: the algorithm and why it is right are there).
The gate calls, releases and renewals are ``gateway.slots``'s (``HeldSlots``).

This module owns the waiting: one future per waiter, the pump task that asks the gate for
the most urgent waiter's slot, and the early slot (asked for while the quota store
reserves). A request goes through it as two stages:

    async with queue.early(req) as early:                 # None when requests wait
        ...reserve...                                     # fails / cancelled: given back
        async with queue.slot(req, early, trace) as slot: # the early slot, or wait for one
            ...call the upstream...                       # however it ends: slot released

and a retry on another member of the pool waits with ``await queue.take(req)`` (the caller
releases that slot).

A client that leaves while waiting is removed at once (its task is cancelled); one that
leaves just as it was granted a slot gives the slot back.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from policies.capacity import CapacityGate
from policies.fair_queue import Entry, FairQueue, Reserve, Shed, ShedReason

from .errors import GatewayError, GatewayTimeout
from .slots import HeldSlots, Limits
from .tracing import NO_TRACE, QUEUE, NoTrace, reject_reason

if TYPE_CHECKING:  # redis is imported only where a gate is shared
    from policies.release_events import ReleaseEvents

log = logging.getLogger("sluice.gateway.queue")

# How often a waiting queue re-tries the gate for capacity another replica freed:
POLL_S = 0.02  # while nobody tells it (no shared gate, or its release events not heard)
# While release events are heard they wake the queue at once, and the poll is only the
# fallback for a lost message (pub/sub delivers at most once: a link down, a dropped
# buffer), which then strands a waiter at most this long. 0.25 s: a rare loss costs about
# one model's time to first token, once, while each waiting queue of each replica asks the
# shared Redis 4 times a second instead of 50 while nothing is released.
FALLBACK_POLL_S = 0.25


def _deaf() -> bool:
    return False


class QueueFull(GatewayError):
    status = 503
    type = "server_error"
    code = "overloaded"


class TenantQueueFull(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "max_queued"


@dataclass(slots=True, frozen=True)
class SlotRequest:
    """What the queue needs of a request (``deadline`` on the loop's clock)."""
    request_id: str
    tenant: str
    weight: float
    priority: int
    tokens: int  # worst case: prompt + max output
    deadline: float | None
    max_queued: int | None
    fail_open: bool = False


@dataclass(slots=True, eq=False)
class Slot:
    """A slot held for a request. ``slot()`` releases it on exit; ``release`` gives it
    back sooner (before a retry elsewhere), once."""
    request_id: str
    tokens: int
    waited_s: float
    _release: Callable[[str, int], None] = field(repr=False)
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._release(self.request_id, self.tokens)


@dataclass(slots=True, eq=False)
class EarlyAttempt:
    """A gate call started before the reservation; ``consumed`` once a slot() took it."""
    request_id: str
    task: asyncio.Task[bool] = field(repr=False)
    consumed: bool = False

    async def granted(self) -> bool:
        """Whether the gate call got the slot (False: queue as usual). The call is
        shielded: a caller cancelled meanwhile leaves it to land, and ``early()`` to undo."""
        try:
            return await asyncio.shield(self.task)
        except GatewayError:
            return False


class Early:
    """``async with queue.early(req) as early`` (small classes, not generator-based
    context managers: every request enters both stages)."""

    __slots__ = ("attempt", "queue", "req")

    def __init__(self, queue: DispatchQueue, req: SlotRequest) -> None:
        self.queue, self.req = queue, req
        self.attempt: EarlyAttempt | None = None

    async def __aenter__(self) -> EarlyAttempt | None:
        q, req = self.queue, self.req
        if not q.size:
            self.attempt = EarlyAttempt(req.request_id, asyncio.ensure_future(
                q.slots.acquire(req.request_id, req.tokens, req.priority, req.fail_open)))
        return self.attempt

    async def __aexit__(self, *exc: object) -> None:
        if self.attempt is not None and not self.attempt.consumed:
            self.queue._drop_early(self.attempt)


class Holding:
    """``async with queue.slot(req, early, trace) as slot``."""

    __slots__ = ("early", "queue", "req", "slot", "trace")

    def __init__(self, queue: DispatchQueue, req: SlotRequest, early: EarlyAttempt | None,
                 trace: NoTrace) -> None:
        self.queue, self.req, self.early, self.trace = queue, req, early, trace
        self.slot: Slot | None = None

    async def __aenter__(self) -> Slot:
        q, req, early, trace = self.queue, self.req, self.early, self.trace
        span = trace.start(QUEUE, {"sluice.queue.length": q.size})
        try:
            if early is not None and not early.consumed and await early.granted():
                early.consumed = True
                held = Slot(req.request_id, req.tokens, 0.0, q.slots.release)
            else:
                held = await q.take(req)
        except GatewayError as err:
            trace.end(span, **{"error.type": reject_reason(err)})
            raise
        except BaseException:
            trace.end(span)
            raise
        ms = int(held.waited_s * 1000)
        trace.set(queue_ms=ms)
        if held.waited_s > 0:  # a request that never waited has no queue span
            trace.end(span, **{"sluice.queue_ms": ms})
        self.slot = held
        return held

    async def __aexit__(self, *exc: object) -> None:
        if self.slot is not None:
            self.slot.release()


@dataclass(slots=True, frozen=True)
class QueueSnapshot:
    upstream: str
    size: int  # requests waiting
    waiting_tokens: int  # their worst-case tokens
    slots_held: int  # slots this replica holds (in-flight requests)
    held_tokens: int  # their worst-case tokens
    dispatched: tuple[tuple[str, int], ...]  # (tenant, dispatched from the queue), by tenant
    drain_rate: float | None  # worst-case tokens released per second lately
    hears_releases: bool = False  # other replicas' releases wake it (else it polls)


@dataclass(slots=True, eq=False)
class Waiter:
    entry: Entry
    fail_open: bool
    future: asyncio.Future[None] = field(repr=False)


class DispatchQueue:
    def __init__(self, upstream: str, gate: CapacityGate, limits: Limits, *,
                 max_len: int, aging_s: float, slot_ttl_s: float, replicas: int = 1,
                 reserve_share: float = 0.0, reserve_priority: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.upstream = upstream
        self.reserve = Reserve(reserve_share, reserve_priority)
        self.clock = clock
        self.policy = FairQueue(max_len=max_len, aging_s=aging_s, clock=clock)
        self._wake = asyncio.Event()
        self._causes: set[str] = set()  # who set _wake since the pump last cleared it
        # the pump's wake-ups by cause: "local" (a slot of this replica back at the gate),
        # "event" (a release event: another replica freed capacity), "push" (a new waiter),
        # "poll" (nobody told it: the poll ran out)
        self.wakeups: dict[str, int] = dict.fromkeys(("local", "event", "push", "poll"), 0)
        # whether release events reach this queue now (``hear_releases`` sets it): then the
        # poll is only a fallback (FALLBACK_POLL_S instead of POLL_S)
        self.hears_releases: Callable[[], bool] = _deaf
        self.slots = HeldSlots(upstream, gate, limits, self.reserve, self.policy,
                               lambda: self._wake_up("local"), ttl_s=slot_ttl_s,
                               replicas=replicas)
        self._waiters: dict[Entry, Waiter] = {}
        self._pump: asyncio.Task[None] | None = None

    # ---- read by others -------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Requests waiting."""
        return self.policy.size

    def load_tokens(self) -> int:
        """Worst-case tokens in flight plus waiting: O(1), for the router on every request
        (``snapshot()`` sorts and prunes, for metrics)."""
        return self.policy.held_tokens + self.policy.waiting_tokens

    def snapshot(self) -> QueueSnapshot:
        p = self.policy
        return QueueSnapshot(self.upstream, p.size, p.waiting_tokens, len(self.slots),
                             p.held_tokens, tuple(sorted(p.dispatched.items())),
                             p.drain_rate(), self.hears_releases())

    def check_invariants(self) -> None:
        """Raise AssertionError if the waiters or slots disagree with the policy's."""
        self.policy.check_invariants()
        waiting = {id(e) for q in self.policy.waiting.values() for e in q}
        if waiting != {id(e) for e in self._waiters}:
            raise AssertionError("waiters and the policy's entries disagree")
        if set(self.slots) != set(self.policy.slots):
            raise AssertionError("slots held at a gate and the policy's slots disagree")

    # ---- stages ---------------------------------------------------------------------------
    def early(self, req: SlotRequest) -> Early:
        """With nobody waiting, ask the gate for a slot now, while the caller reserves
        (None when requests wait: they go first); on exit a slot it got (or gets) is given
        back unless ``slot()`` took it."""
        return Early(self, req)

    def slot(self, req: SlotRequest, early: EarlyAttempt | None = None,
             trace: NoTrace = NO_TRACE) -> Holding:
        """Take the early attempt's slot or wait for one (503/429/504 GatewayErrors), the
        wait traced as the ``sluice.queue.wait`` phase; on exit, however the block ends,
        release it with the request's worst-case tokens."""
        if early is not None and early.request_id != req.request_id:
            raise ValueError(f"the early attempt of {early.request_id!r} is not "
                             f"{req.request_id!r}'s")
        return Holding(self, req, early, trace)

    async def take(self, req: SlotRequest) -> Slot:
        """Wait for a slot as ``slot()`` does, untraced (a retry on another member); the
        caller releases it."""
        return Slot(req.request_id, req.tokens, await self._acquire(req), self.slots.release)

    async def renew_all(self) -> None:
        await self.slots.renew_all()

    def released_elsewhere(self) -> None:
        """A release event: capacity of this upstream came back at the shared gate."""
        self._wake_up("event")

    async def aclose(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        await self.slots.aclose()

    # ---- internals ------------------------------------------------------------------------
    async def _acquire(self, req: SlotRequest) -> float:
        """Wait for a slot; returns the seconds waited. Raises 503/429/504 GatewayErrors."""
        start = self.clock()
        if self.size == 0 and await self.slots.acquire(req.request_id, req.tokens, req.priority,
                                                    req.fail_open):
            return 0.0
        shed = self.policy.shed(req.tenant, req.priority, req.tokens, req.max_queued,
                                req.deadline, start)
        if shed is not None:
            raise self._refusal(shed, req.max_queued)
        entry = self.policy.push(req.request_id, req.tenant, req.weight, req.priority,
                                 req.tokens, start)
        w = Waiter(entry, req.fail_open, asyncio.get_running_loop().create_future())
        self._waiters[entry] = w
        self._start_pump()
        try:
            if req.deadline is None:
                await w.future
            else:
                async with asyncio.timeout_at(req.deadline):
                    await w.future
        except BaseException as exc:
            if w.future.done() and not w.future.cancelled() and w.future.exception() is None:
                self.slots.release(req.request_id, 0)  # granted just as we left
            if isinstance(exc, TimeoutError):
                raise GatewayTimeout(f"the request's deadline passed after "
                                     f"{self.clock() - start:.3f} s in the queue",
                                     code="deadline_exceeded") from None
            raise
        finally:
            self._remove(w)
        return self.clock() - start

    def _drop_early(self, attempt: EarlyAttempt) -> None:
        """The request will not run: give back a slot the early attempt got, or gets."""
        def give_back(done: asyncio.Task[bool]) -> None:
            if not done.cancelled() and done.exception() is None and done.result():
                self.slots.release(attempt.request_id, 0)

        if attempt.task.done():
            give_back(attempt.task)
        else:
            attempt.task.add_done_callback(give_back)

    def _refusal(self, shed: Shed, max_queued: int | None) -> GatewayError:
        retry = shed.retry_after_s
        if shed.reason is ShedReason.FULL:
            return QueueFull(f"the model {self.upstream!r} is overloaded ({self.size} "
                             f"requests waiting)", retry_after_s=retry)
        if shed.reason is ShedReason.MAX_QUEUED:
            return TenantQueueFull(f"you have {max_queued} requests waiting already (your "
                                   f"max_queued)", "max_queued", retry_after_s=retry)
        shown = shed.predicted_wait_s or 0.0
        return QueueFull(f"the predicted wait ({shown:.3f} s) is longer than the request's "
                         f"deadline allows", "deadline_ms",
                         code="deadline_unreachable", retry_after_s=retry)

    def _remove(self, w: Waiter) -> None:
        self.policy.remove(w.entry)
        self._waiters.pop(w.entry, None)

    def _start_pump(self) -> None:
        if self._pump is None or self._pump.done():
            # in a context of its own: started by a request, it outlives it, and must not
            # carry that request's trace context (its store calls would join that trace)
            self._pump = asyncio.get_running_loop().create_task(
                self._run(), context=contextvars.Context())
        self._wake_up("push")

    def _wake_up(self, cause: str) -> None:
        self._causes.add(cause)
        self._wake.set()

    def _pick(self, urgent_only: bool = False) -> Waiter | None:
        def eligible(e: Entry) -> bool:
            return not self._waiters[e].future.done() and (not urgent_only or
                                                            self.reserve.urgent(e.priority))

        entry = self.policy.pick(eligible)
        return None if entry is None else self._waiters[entry]

    async def _run(self) -> None:
        """Dispatch while there is room; when there is not, sleep until a release here, a
        release event from another replica, or the poll (POLL_S, or FALLBACK_POLL_S while
        events are heard)."""
        while self.size:
            # Cleared before the gate call, not after: a release that lands while the call
            # is in flight sets it again, and the wait below returns at once (no lost wake).
            self._wake.clear()
            self._causes.clear()
            w = self._pick()
            if w is None:
                await asyncio.sleep(POLL_S)
                continue
            e = w.entry
            try:
                granted = await self.slots.acquire(e.request_id, e.tokens, e.priority, w.fail_open)
                if not granted and self.reserve.share and not self.reserve.urgent(e.priority):
                    # the batch request at the head is held to its share; an urgent one
                    # behind it may still fit in the reserve
                    u = self._pick(urgent_only=True)
                    if u is not None:
                        w, e = u, u.entry
                        granted = await self.slots.acquire(e.request_id, e.tokens, e.priority,
                                                        w.fail_open)
            except GatewayError as err:
                if not w.future.done():
                    w.future.set_exception(err)
                log.warning("capacity gate of %s unreachable: %s", self.upstream, err)
                self._remove(w)
                continue
            if granted:
                self.policy.dispatch(e)
                self._waiters.pop(e, None)
                if w.future.done():  # it left meanwhile
                    self.slots.release(e.request_id, 0)
                else:
                    w.future.set_result(None)
                continue
            try:
                async with asyncio.timeout(FALLBACK_POLL_S if self.hears_releases()
                                           else POLL_S):
                    await self._wake.wait()
            except TimeoutError:
                self.wakeups["poll"] += 1
            else:
                for cause in self._causes:
                    self.wakeups[cause] += 1


def hear_releases(queues: Mapping[str, DispatchQueue], gate: CapacityGate,
                  **opts: Any) -> ReleaseEvents | None:
    """Release events for the queues of a shared gate, not yet started (None when no other
    replica shares ``gate``): each queue is woken by its upstream's events, and polls the
    gate only as a fallback while it hears them. ``opts``: ``ReleaseEvents``' own."""
    from policies.capacity import RedisGate

    if not isinstance(gate, RedisGate) or not queues:
        return None
    from policies.release_events import ReleaseEvents

    events = ReleaseEvents(gate.client, {k: gate.channel(k) for k in queues},
                           {k: q.released_elsewhere for k, q in queues.items()}, **opts)
    for key, queue in queues.items():
        queue.hears_releases = partial(events.hears, key)
    return events
