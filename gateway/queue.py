"""The dispatch queue of one upstream, in asyncio: waiters, the pump, the capacity gate.

A request waits here (after its quota reservation) until the upstream has room for it: the
capacity gate (``policies.capacity``) grants a slot while the upstream's in-flight
worst-case tokens stay within its KV token capacity × overcommit and its in-flight
sequences within its max. With room and nobody waiting, a request passes straight through.
Who goes next, who is shed and the predicted wait are ``policies.fair_queue``'s (order,
fair share, aging, reserve, drain estimate: the algorithm and why it is right are there).

This module owns what needs a loop: one future per waiter, the pump task that asks the gate
for the most urgent waiter's slot, the gate calls (and a local fail-open gate while the
shared one is unreachable), releases in tasks the queue owns, slot renewals, and the early
slot (asked for while the quota store reserves).

    async with queue.early(req) as early:            # None when requests wait
        ...reserve...                                # fails / cancelled: early slot given back
        async with queue.slot(req, early) as slot:   # the early slot, or wait for one
            ...call the upstream...                  # however it ends: slot released

A client that leaves while waiting is removed at once (its task is cancelled); one that
leaves just as it was granted a slot gives the slot back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import types
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from policies.capacity import CapacityGate, MemoryGate
from policies.fair_queue import DEFAULT_RETRY_S, Entry, FairQueue, Reserve, Shed, ShedReason
from policies.store import StoreUnavailable

from .errors import GatewayError, GatewayTimeout, ServiceUnavailable

log = logging.getLogger("sluice.gateway.queue")

POLL_S = 0.02  # other replicas' releases are not announced: re-try the gate this often
UNDO_AGAIN_S = 1.0  # a second try at undoing a timed-out slot acquire (it may land late)


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
    early: bool  # the early attempt's slot
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


@dataclass(slots=True, frozen=True)
class QueueSnapshot:
    upstream: str
    size: int  # requests waiting
    waiting_tokens: int  # their worst-case tokens
    slots_held: int  # slots this replica holds (in-flight requests)
    held_tokens: int  # their worst-case tokens
    dispatched: tuple[tuple[str, int], ...]  # (tenant, dispatched from the queue), by tenant
    drain_rate: float | None  # worst-case tokens released per second lately


@dataclass(slots=True, eq=False)
class Waiter:
    entry: Entry
    fail_open: bool
    future: asyncio.Future[None] = field(repr=False)


Limits = Callable[[], tuple[int | None, int | None]]  # (cap_tokens, cap_seqs) now
UNGATED: CapacityGate = MemoryGate()  # marks slots of an upstream without capacity limits


class DispatchQueue:
    def __init__(self, upstream: str, gate: CapacityGate, limits: Limits, *,
                 max_len: int, aging_s: float, slot_ttl_s: float, replicas: int = 1,
                 reserve_share: float = 0.0, reserve_priority: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.upstream = upstream
        self.gate = gate
        # While the shared gate is unreachable, fail-open tenants use this replica's share.
        self.local_gate = MemoryGate()
        self.replicas = replicas
        self.limits = limits
        self.reserve = Reserve(reserve_share, reserve_priority)
        self.slot_ttl_s = slot_ttl_s
        self.clock = clock
        self.policy = FairQueue(max_len=max_len, aging_s=aging_s, clock=clock)
        self._waiters: dict[Entry, Waiter] = {}
        self._gates: dict[str, CapacityGate] = {}  # slots this replica holds, and where
        self._wake = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None
        self._releasing: set[asyncio.Task[None]] = set()

    # ---- read by others (prefer snapshot()) -----------------------------------------------
    @property
    def reserve_share(self) -> float:
        return self.reserve.share

    @property
    def reserve_priority(self) -> int:
        return self.reserve.priority

    @property
    def size(self) -> int:
        return self.policy.size

    @property
    def waiting(self) -> Mapping[tuple[str, int], Sequence[Entry]]:
        return self.policy.waiting

    @property
    def dispatched(self) -> Mapping[str, int]:
        return self.policy.dispatched

    @property
    def held(self) -> Mapping[str, CapacityGate]:
        """The slots this replica holds, and on which gate."""
        return types.MappingProxyType(self._gates)

    @property
    def held_tokens(self) -> int:
        """Worst-case tokens of the requests this replica has in flight upstream."""
        return self.policy.held_tokens

    def snapshot(self) -> QueueSnapshot:
        p = self.policy
        return QueueSnapshot(self.upstream, p.size, p.waiting_tokens, len(self._gates),
                             p.held_tokens, tuple(sorted(p.dispatched.items())),
                             p.drain_rate())

    def check_invariants(self) -> None:
        """Raise AssertionError if the waiters or slots disagree with the policy's."""
        self.policy.check_invariants()
        waiting = {id(e) for q in self.policy.waiting.values() for e in q}
        if waiting != {id(e) for e in self._waiters}:
            raise AssertionError("waiters and the policy's entries disagree")
        if set(self._gates) != set(self.policy.slots):
            raise AssertionError("slots held at a gate and the policy's slots disagree")

    # ---- stages ---------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def early(self, req: SlotRequest) -> AsyncIterator[EarlyAttempt | None]:
        """With nobody waiting, ask the gate for a slot now, while the caller reserves; on
        exit a slot it got (or gets) is given back unless ``slot()`` took it."""
        task = self.try_early(req.request_id, req.tokens, req.fail_open, req.priority)
        attempt = None if task is None else EarlyAttempt(req.request_id, task)
        try:
            yield attempt
        finally:
            if attempt is not None and not attempt.consumed:
                self.drop_early(req.request_id, attempt.task)

    @contextlib.asynccontextmanager
    async def slot(self, req: SlotRequest,
                   early: EarlyAttempt | None = None) -> AsyncIterator[Slot]:
        """Take the early attempt's slot or wait for one (503/429/504 GatewayErrors); on
        exit, however the block ends, release it with the request's worst-case tokens."""
        if early is not None and early.request_id != req.request_id:
            raise ValueError(f"the early attempt of {early.request_id!r} is not "
                             f"{req.request_id!r}'s")
        if early is not None and not early.consumed and await self.took_early(early.task):
            early.consumed = True
            held = Slot(req.request_id, req.tokens, 0.0, True, self.release)
        else:
            waited = await self.acquire(req.request_id, req.tenant, req.weight, req.priority,
                                        req.tokens, req.deadline, req.max_queued,
                                        fail_open=req.fail_open)
            held = Slot(req.request_id, req.tokens, waited, False, self.release)
        try:
            yield held
        finally:
            held.release()

    # ---- public ---------------------------------------------------------------------------
    async def acquire(self, request_id: str, tenant: str, weight: float, priority: int,
                      tokens: int, deadline: float | None, max_queued: int | None,
                      fail_open: bool = False) -> float:
        """Wait for a slot; returns the seconds waited. Raises 503/429/504 GatewayErrors."""
        start = self.clock()
        if self.size == 0 and await self._try(request_id, tokens, fail_open, priority):
            return 0.0
        shed = self.policy.shed(tenant, priority, tokens, max_queued, deadline, start)
        if shed is not None:
            raise self._refusal(shed, max_queued)
        entry = self.policy.push(request_id, tenant, weight, priority, tokens, start)
        w = Waiter(entry, fail_open, asyncio.get_running_loop().create_future())
        self._waiters[entry] = w
        self._start_pump()
        try:
            if deadline is None:
                await w.future
            else:
                async with asyncio.timeout_at(deadline):
                    await w.future
        except BaseException as exc:
            if w.future.done() and not w.future.cancelled() and w.future.exception() is None:
                self.release(request_id, 0)  # granted just as we left: give the slot back
            if isinstance(exc, TimeoutError):
                raise GatewayTimeout(f"the request's deadline passed after "
                                     f"{self.clock() - start:.3f} s in the queue",
                                     code="deadline_exceeded") from None
            raise
        finally:
            self._remove(w)
        return self.clock() - start

    def try_early(self, request_id: str, tokens: int, fail_open: bool,
                  priority: int) -> asyncio.Task[bool] | None:
        """With nobody waiting, start asking the gate for a slot now (before the quota
        reservation is known); None when requests wait (they go first)."""
        if self.size:
            return None
        return asyncio.ensure_future(self._try(request_id, tokens, fail_open, priority))

    async def took_early(self, early: asyncio.Task[bool]) -> bool:
        """Whether the early attempt got the slot (False: queue as usual)."""
        try:
            return await asyncio.shield(early)
        except GatewayError:
            return False

    def drop_early(self, request_id: str, early: asyncio.Task[bool] | None) -> None:
        """The request will not run: give back a slot the early attempt got, or gets."""
        if early is None:
            return

        def give_back(done: asyncio.Task[bool]) -> None:
            if not done.cancelled() and done.exception() is None and done.result():
                self.release(request_id, 0)

        if early.done():
            give_back(early)
        else:
            early.add_done_callback(give_back)

    def release(self, request_id: str, tokens: int) -> None:
        """Give a slot back (idempotent), in a task the queue owns: a cancelled request
        cannot cancel its own release."""
        if request_id not in self._gates:
            return
        self._own(self._give_back(request_id, tokens))

    def predicted_wait(self, priority: int, tokens: int) -> float | None:
        return self.policy.predicted_wait(priority, tokens)

    def drain_rate(self) -> float | None:
        return self.policy.drain_rate()

    def urgent(self, priority: int) -> bool:
        """Whether a request of this priority may use the reserve."""
        return self.reserve.urgent(priority)

    async def renew_all(self) -> None:
        for rid, gate in list(self._gates.items()):
            if gate is UNGATED:
                continue
            with contextlib.suppress(StoreUnavailable):
                await gate.renew(self.upstream, rid, self.slot_ttl_s)

    async def aclose(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        if self._releasing:
            await asyncio.wait(self._releasing, timeout=5.0)

    # ---- internals ------------------------------------------------------------------------
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

    def _own(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _try(self, request_id: str, tokens: int, fail_open: bool, priority: int) -> bool:
        cap_tokens, cap_seqs = self.reserve.caps(priority, *self.limits())
        if cap_tokens is None and cap_seqs is None:
            # An upstream of unknown capacity has no gate: no store round trip to make.
            self._grant(request_id, tokens, UNGATED)
            return True
        gate: CapacityGate = self.gate
        try:
            ok = await gate.acquire(self.upstream, request_id, tokens, cap_tokens, cap_seqs,
                                    self.slot_ttl_s)
        except StoreUnavailable as exc:
            self._undo_lost(request_id)
            if not fail_open:
                raise ServiceUnavailable("the capacity gate is unreachable",
                                         retry_after_s=DEFAULT_RETRY_S,
                                         code="store_unavailable") from exc
            gate = self.local_gate
            ok = await gate.acquire(self.upstream, request_id, tokens,
                                    _share(cap_tokens, self.replicas),
                                    _share(cap_seqs, self.replicas), self.slot_ttl_s)
        if ok:
            self._grant(request_id, tokens, gate)
        return ok

    def _grant(self, request_id: str, tokens: int, gate: CapacityGate) -> None:
        self._gates[request_id] = gate
        self.policy.grant(request_id, tokens)

    async def _give_back(self, request_id: str, tokens: int) -> None:
        gate = self._gates.pop(request_id, None)
        if gate is None:
            return
        self.policy.release(request_id, tokens)
        if gate is UNGATED:
            self._wake.set()
            return
        try:
            await gate.release(self.upstream, request_id)
        except StoreUnavailable:
            log.warning("releasing slot %s of %s failed; it expires in %.0f s", request_id,
                        self.upstream, self.slot_ttl_s)
        self._wake.set()

    def _undo_lost(self, request_id: str) -> None:
        """An acquire that timed out may still have taken the slot in Redis (slow, not
        down): release it now and once more later, as it may land late (a no-op if it never
        landed), in a task the queue owns."""
        async def undo() -> None:
            for wait in (0.0, UNDO_AGAIN_S):
                await asyncio.sleep(wait)
                if self._gates.get(request_id) is self.gate:
                    return  # granted since (a retry of the same id): the slot is in use
                with contextlib.suppress(StoreUnavailable):
                    if await self.gate.release(self.upstream, request_id):
                        return

        self._own(undo())

    def _remove(self, w: Waiter) -> None:
        self.policy.remove(w.entry)
        self._waiters.pop(w.entry, None)

    def _start_pump(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = asyncio.ensure_future(self._run())
        self._wake.set()

    def _pick(self, urgent_only: bool = False) -> Waiter | None:
        def eligible(e: Entry) -> bool:
            return not self._waiters[e].future.done() and (not urgent_only or
                                                            self.urgent(e.priority))

        entry = self.policy.pick(eligible)
        return None if entry is None else self._waiters[entry]

    async def _run(self) -> None:
        """Dispatch while there is room; sleep until a release (or a poll for other
        replicas' releases) when there is not."""
        while self.size:
            w = self._pick()
            if w is None:
                await asyncio.sleep(POLL_S)
                continue
            e = w.entry
            try:
                granted = await self._try(e.request_id, e.tokens, w.fail_open, e.priority)
                if not granted and self.reserve.share and not self.urgent(e.priority):
                    # the batch request at the head is held to its share; an urgent one
                    # behind it may still fit in the reserve
                    u = self._pick(urgent_only=True)
                    if u is not None:
                        w, e = u, u.entry
                        granted = await self._try(e.request_id, e.tokens, w.fail_open,
                                                  e.priority)
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
                    self.release(e.request_id, 0)
                else:
                    w.future.set_result(None)
                continue
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_S):
                    await self._wake.wait()


def _share(cap: int | None, replicas: int) -> int | None:
    return None if cap is None else max(1, cap // replicas)
