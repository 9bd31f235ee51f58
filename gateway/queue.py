"""The dispatch queue of one upstream: bounded, by priority with aging, fair across tenants.

A request waits here (after its quota reservation) until the upstream has room for it: the
capacity gate (``policies.capacity``) grants a slot while the upstream's in-flight
worst-case tokens stay within its KV token capacity × overcommit and its in-flight
sequences within its max. With room and nobody waiting, a request passes straight through.

Order. The class of a waiting request is ``priority - floor(waited / aging_s)`` (lower is
more urgent), so low priority eventually runs. Within the most urgent class, the tenant with
the least *virtual time* goes first; a dispatch advances its tenant's virtual time by
``1 / weight``, and a tenant that starts waiting starts at the least virtual time of those
waiting (no credit banked while idle): one tenant flooding cannot starve another of the
same class, which gets its weighted share of dispatches.

Shedding, at enqueue:
    queue full (``max_len``) or the tenant's ``max_queued``      503 / 429
    predicted wait > the request's deadline                      503
    the deadline passes while waiting                            504
with ``predicted wait = worst-case tokens waiting ahead (this request's class or more
urgent, plus its own) ÷ drain rate``, the drain rate being the worst-case tokens of slots
released per second over the last ``DRAIN_WINDOW_S`` (or since the first slot, if sooner).
Before any slot was released there is no rate, and no request is shed by prediction. Retry-After is that predicted wait.

Reserve for urgent work (``queue.reserve_share``, off by default). A request with a priority
above ``queue.reserve_priority`` (batch) starts only while the upstream's in-flight
sequences and worst-case tokens, its own included, stay within ``1 - reserve_share`` of the
capacity; urgent requests may use all of it. Without a reserve, long batch generations can
hold every slot, and an interactive request waits for one of them to finish however urgent
it is. The check is on the upstream's total (one atomic gate call, shared by replicas), so
while urgent work alone fills more than the batch share, batch waits: strict priority, as
in the queue's order; aging moves a batch request ahead of other batch, never into the
reserve.

A client that leaves while waiting is removed at once (its task is cancelled); one that
leaves just as it was granted a slot gives the slot back.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from policies.capacity import CapacityGate, MemoryGate
from policies.store import StoreUnavailable

from .errors import GatewayError, GatewayTimeout, ServiceUnavailable

log = logging.getLogger("sluice.gateway.queue")

DRAIN_WINDOW_S = 10.0
POLL_S = 0.02  # other replicas' releases are not announced: re-try the gate this often
DEFAULT_RETRY_S = 1.0
UNDO_AGAIN_S = 1.0  # a second try at undoing a timed-out slot acquire (it may land late)


class QueueFull(GatewayError):
    status = 503
    type = "server_error"
    code = "overloaded"


class TenantQueueFull(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "max_queued"


@dataclass(slots=True, eq=False)
class Waiter:
    request_id: str
    tenant: str
    weight: float
    priority: int
    tokens: int
    arrival: float
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
        self.max_len = max_len
        self.aging_s = aging_s
        self.reserve_share = reserve_share
        self.reserve_priority = reserve_priority
        self.slot_ttl_s = slot_ttl_s
        self.clock = clock
        self.waiting: dict[tuple[str, int], collections.deque[Waiter]] = {}
        self.size = 0
        self.per_tenant: dict[str, int] = {}
        self.vtime: dict[str, float] = {}
        self.dispatched: dict[str, int] = {}
        self.held: dict[str, CapacityGate] = {}  # slots this replica holds, and where
        self._held_tokens: dict[str, int] = {}  # … and the worst-case tokens of each
        self._drained: collections.deque[tuple[float, int]] = collections.deque()
        self._wake = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None
        self._releasing: set[asyncio.Task[None]] = set()
        self._first_slot: float | None = None

    # ---- public ---------------------------------------------------------------------------
    async def acquire(self, request_id: str, tenant: str, weight: float, priority: int,
                      tokens: int, deadline: float | None, max_queued: int | None,
                      fail_open: bool = False) -> float:
        """Wait for a slot; returns the seconds waited. Raises 503/429/504 GatewayErrors."""
        start = self.clock()
        if self.size == 0 and await self._try(request_id, tokens, fail_open, priority):
            return 0.0
        wait = self.predicted_wait(priority, tokens)
        retry = DEFAULT_RETRY_S if wait is None else max(wait, 0.001)
        if self.size >= self.max_len:
            raise QueueFull(f"the model {self.upstream!r} is overloaded ({self.size} requests "
                            f"waiting)", retry_after_s=retry)
        if max_queued is not None and self.per_tenant.get(tenant, 0) >= max_queued:
            raise TenantQueueFull(f"you have {max_queued} requests waiting already (your "
                                  f"max_queued)", "max_queued", retry_after_s=retry)
        if deadline is not None and wait is not None and start + wait > deadline:
            raise QueueFull(f"the predicted wait ({wait:.3f} s) is longer than the request's "
                            f"deadline allows", "deadline_ms", code="deadline_unreachable",
                            retry_after_s=retry)
        w = Waiter(request_id, tenant, weight, priority, tokens, start, fail_open,
                   asyncio.get_running_loop().create_future())
        self._push(w)
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
        if request_id not in self.held:
            return
        task = asyncio.ensure_future(self._give_back(request_id, tokens))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    @property
    def held_tokens(self) -> int:
        """Worst-case tokens of the requests this replica has in flight upstream."""
        return sum(self._held_tokens.values())

    def predicted_wait(self, priority: int, tokens: int) -> float | None:
        rate = self.drain_rate()
        if rate is None:
            return None
        now = self.clock()
        ahead = sum(w.tokens for q in self.waiting.values() for w in q
                    if self._class(w, now) <= priority)
        return (ahead + tokens) / rate

    def drain_rate(self) -> float | None:
        now = self.clock()
        while self._drained and self._drained[0][0] < now - DRAIN_WINDOW_S:
            self._drained.popleft()
        if not self._drained or self._first_slot is None:
            return None
        # released over the window, or over the time since slots were first handed out
        span = max(min(now - self._first_slot, DRAIN_WINDOW_S), 1.0)
        released = sum(t for _, t in self._drained)
        return released / span if released > 0 else None  # slots given back unused: no rate

    async def renew_all(self) -> None:
        for rid, gate in list(self.held.items()):
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
    def urgent(self, priority: int) -> bool:
        """Whether a request of this priority may use the reserve."""
        return priority <= self.reserve_priority

    async def _try(self, request_id: str, tokens: int, fail_open: bool, priority: int) -> bool:
        cap_tokens, cap_seqs = self.limits()
        if self.reserve_share and not self.urgent(priority):
            cap_tokens, cap_seqs = (_less(cap_tokens, self.reserve_share),
                                    _less(cap_seqs, self.reserve_share))
        if cap_tokens is None and cap_seqs is None:
            # An upstream of unknown capacity has no gate: no store round trip to make.
            self.held[request_id] = UNGATED
            self._held_tokens[request_id] = tokens
            if self._first_slot is None:
                self._first_slot = self.clock()
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
            self.held[request_id] = gate
            self._held_tokens[request_id] = tokens
            if self._first_slot is None:
                self._first_slot = self.clock()
        return ok

    async def _give_back(self, request_id: str, tokens: int) -> None:
        gate = self.held.pop(request_id, None)
        self._held_tokens.pop(request_id, None)
        if gate is None:
            return
        self._drained.append((self.clock(), tokens))
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
                if self.held.get(request_id) is self.gate:
                    return  # granted since (a retry of the same id): the slot is in use
                with contextlib.suppress(StoreUnavailable):
                    if await self.gate.release(self.upstream, request_id):
                        return

        task = asyncio.ensure_future(undo())
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    def _class(self, w: Waiter, now: float) -> int:
        return w.priority - math.floor((now - w.arrival) / self.aging_s)

    def _push(self, w: Waiter) -> None:
        key = (w.tenant, w.priority)
        if w.tenant not in self.per_tenant or self.per_tenant[w.tenant] == 0:
            # A tenant that starts waiting starts level with those waiting: no banked credit.
            active = [self.vtime[t] for t, n in self.per_tenant.items() if n and t in self.vtime]
            self.vtime[w.tenant] = max(self.vtime.get(w.tenant, 0.0), min(active, default=0.0))
        self.waiting.setdefault(key, collections.deque()).append(w)
        self.size += 1
        self.per_tenant[w.tenant] = self.per_tenant.get(w.tenant, 0) + 1
        if self._pump is None or self._pump.done():
            self._pump = asyncio.ensure_future(self._run())
        self._wake.set()

    def _remove(self, w: Waiter) -> None:
        q = self.waiting.get((w.tenant, w.priority))
        if q is None:
            return
        with contextlib.suppress(ValueError):
            q.remove(w)
            self.size -= 1
            self.per_tenant[w.tenant] -= 1
        if not q:
            del self.waiting[(w.tenant, w.priority)]

    def _pick(self, urgent_only: bool = False) -> Waiter | None:
        now = self.clock()
        best: tuple[int, float, float] | None = None
        chosen: Waiter | None = None
        for q in self.waiting.values():
            head = q[0]
            if head.future.done() or (urgent_only and not self.urgent(head.priority)):
                continue
            key = (self._class(head, now), self.vtime.get(head.tenant, 0.0), head.arrival)
            if best is None or key < best:
                best, chosen = key, head
        return chosen

    async def _run(self) -> None:
        """Dispatch while there is room; sleep until a release (or a poll for other
        replicas' releases) when there is not."""
        while self.size:
            w = self._pick()
            if w is None:
                await asyncio.sleep(POLL_S)
                continue
            try:
                granted = await self._try(w.request_id, w.tokens, w.fail_open, w.priority)
                if not granted and self.reserve_share and not self.urgent(w.priority):
                    # the batch request at the head is held to its share; an urgent one
                    # behind it may still fit in the reserve
                    u = self._pick(urgent_only=True)
                    if u is not None:
                        w = u
                        granted = await self._try(w.request_id, w.tokens, w.fail_open,
                                                  w.priority)
            except GatewayError as err:
                if not w.future.done():
                    w.future.set_exception(err)
                log.warning("capacity gate of %s unreachable: %s", self.upstream, err)
                self._remove(w)
                continue
            if granted:
                self._remove(w)
                self.vtime[w.tenant] = self.vtime.get(w.tenant, 0.0) + 1.0 / w.weight
                self.dispatched[w.tenant] = self.dispatched.get(w.tenant, 0) + 1
                if w.future.done():  # it left meanwhile
                    self.release(w.request_id, 0)
                else:
                    w.future.set_result(None)
                continue
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_S):
                    await self._wake.wait()


def _less(cap: int | None, reserve_share: float) -> int | None:
    """What is left of a capacity for batch work once the reserve is set aside."""
    return None if cap is None else max(1, math.floor(cap * (1 - reserve_share)))


def _share(cap: int | None, replicas: int) -> int | None:
    return None if cap is None else max(1, cap // replicas)
