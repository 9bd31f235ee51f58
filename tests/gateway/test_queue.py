"""The dispatch queue: capacity gate, fairness across tenants, priority with aging,
shedding by predicted wait and deadline, and leaving while queued."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from gateway.errors import GatewayError
from gateway.queue import DispatchQueue, EarlyAttempt, QueueSnapshot, Slot, SlotRequest
from policies.capacity import MemoryGate


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(cap_seqs: int | None = 1, cap_tokens: int | None = None, **kw: Any) -> DispatchQueue:
    opts: dict[str, Any] = {"max_len": 1000, "aging_s": 5.0, "slot_ttl_s": 30.0, **kw}
    return DispatchQueue("m", MemoryGate(), lambda: (cap_tokens, cap_seqs), **opts)


class Clients:
    """Requests that take slots through ``slot()``, as the gateway's do, and hold them
    until ``release`` (or the end of the test)."""

    def __init__(self) -> None:
        self.stack = contextlib.AsyncExitStack()
        self.slots: dict[str, Slot] = {}

    async def take(self, q: DispatchQueue, rid: str, tenant: str, weight: float,
                   priority: int, tokens: int, deadline: float | None,
                   max_queued: int | None) -> float:
        """Wait for a slot; the seconds waited (503/429/504 GatewayErrors as slot())."""
        req = SlotRequest(rid, tenant, weight, priority, tokens, deadline, max_queued)
        slot = await self.stack.enter_async_context(q.slot(req))
        self.slots[rid] = slot
        return slot.waited_s

    def release(self, rid: str) -> None:
        """Give the slot back with its worst-case tokens, as leaving slot() does."""
        self.slots[rid].release()


@pytest.fixture
async def clients() -> AsyncIterator[Clients]:
    c = Clients()
    async with c.stack:
        yield c


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def run_order(q: DispatchQueue, c: Clients, requests: list[tuple[str, str, int]],
                    weights: dict[str, float] | None = None, clock: Clock | None = None,
                    step: float = 0.0) -> list[str]:
    """Hold the one slot, queue ``requests`` (id, tenant, priority), then release one slot at
    a time; returns the order in which ids were dispatched."""
    await c.take(q, "holder", "x", 1.0, 0, 1, None, None)
    order: list[str] = []

    async def one(rid: str, tenant: str, prio: int) -> None:
        await c.take(q, rid, tenant, (weights or {}).get(tenant, 1.0), prio, 1, None, None)
        order.append(rid)

    tasks = [asyncio.ensure_future(one(*r)) for r in requests]
    await settle()
    assert q.size == len(requests)
    current = "holder"
    for n in range(len(requests)):
        if clock is not None:
            clock.now += step
        c.release(current)
        while len(order) < n + 1:
            await asyncio.sleep(0.001)
        current = order[-1]
    await asyncio.gather(*tasks)
    return order


async def test_a_flooding_tenant_does_not_starve_another(clients: Clients) -> None:
    q = make()
    flood = [(f"a{i}", "a", 5) for i in range(40)]
    trickle = [(f"b{i}", "b", 5) for i in range(10)]
    order = await run_order(q, clients, flood + trickle)
    first = order[:20]
    # b arrived after all 40 of a, yet gets its equal share of dispatches at once
    assert sum(r.startswith("b") for r in first) == 10


async def test_weights_set_the_share(clients: Clients) -> None:
    q = make()
    reqs = [(f"a{i}", "a", 5) for i in range(30)] + [(f"b{i}", "b", 5) for i in range(30)]
    order = await run_order(q, clients, reqs, weights={"a": 3.0, "b": 1.0})
    first = order[:20]
    share_a = sum(r.startswith("a") for r in first) / 20
    assert abs(share_a - 0.75) <= 0.1


async def test_priority_first_and_aging_prevents_starvation(clients: Clients) -> None:
    clock = Clock()
    q = make(clock=clock, aging_s=1.0)
    await clients.take(q, "holder", "x", 1.0, 0, 1, None, None)
    order: list[str] = []

    async def one(rid: str, prio: int) -> None:
        await clients.take(q, rid, "t", 1.0, prio, 1, None, None)
        order.append(rid)

    tasks = [asyncio.ensure_future(one("low", 9))]
    current = "holder"
    # a fresh urgent request arrives every second, and one request is served per second
    for n in range(15):
        tasks.append(asyncio.ensure_future(one(f"high{n}", 0)))
        await settle()
        clock.now += 1.0
        clients.release(current)
        while len(order) < n + 1:
            await asyncio.sleep(0.001)
        current = order[-1]
    assert order[0] == "high0"  # urgent first, though it arrived later
    # the waiting low-priority request ages one class per second: it is served once its
    # class reaches the newcomers' (~9 s), not never
    assert "low" in order and 8 <= order.index("low") <= 11, order
    for t in tasks:
        t.cancel()


async def test_capacity_in_tokens_gates_dispatch(clients: Clients) -> None:
    q = make(cap_seqs=None, cap_tokens=100)
    await clients.take(q, "r1", "t", 1.0, 5, 60, None, None)
    waiter = asyncio.ensure_future(clients.take(q, "r2", "t", 1.0, 5, 60, None, None))
    await settle()
    assert not waiter.done() and q.size == 1  # 60 + 60 > 100
    clients.release("r1")
    await asyncio.wait_for(waiter, 2)
    # a request bigger than the whole capacity runs alone rather than never
    clients.release("r2")
    await settle()
    assert await clients.take(q, "huge", "t", 1.0, 5, 500, None, None) == 0.0


async def test_shedding_by_queue_length_max_queued_and_predicted_wait(clients: Clients) -> None:
    clock = Clock()
    q = make(clock=clock, max_len=2)
    await clients.take(q, "holder", "t", 1.0, 5, 100, None, None)
    w1 = asyncio.ensure_future(clients.take(q, "w1", "t", 1.0, 5, 100, None, 1))
    await settle()
    with pytest.raises(GatewayError) as mq:  # the tenant's max_queued (1)
        await clients.take(q, "w2", "t", 1.0, 5, 100, None, 1)
    assert mq.value.status == 429 and mq.value.param == "max_queued"
    w2 = asyncio.ensure_future(clients.take(q, "w2", "u", 1.0, 5, 100, None, None))
    await settle()
    with pytest.raises(GatewayError) as full:
        await clients.take(q, "w3", "v", 1.0, 5, 100, None, None)
    assert full.value.status == 503 and full.value.retry_after_s is not None
    # drain rate: 100 worst-case tokens released over 10 s -> 10 tokens/s
    clock.now += 10
    clients.release("holder")
    await asyncio.wait_for(w1, 2)
    rate = q.snapshot().drain_rate
    assert rate is not None and abs(rate - 10.0) < 1e-6
    # w2 waits (100 ahead of a new 100 at this priority): predicted 20 s > a 5 s deadline
    with pytest.raises(GatewayError) as late:
        await clients.take(q, "w4", "z", 1.0, 5, 100, clock.now + 5, None)
    assert late.value.status == 503 and late.value.code == "deadline_unreachable"
    assert late.value.retry_after_s == pytest.approx(20.0)
    w2.cancel()


async def test_a_deadline_passing_in_the_queue_is_504_and_leaves_nothing(clients: Clients) -> None:
    q = make()
    await clients.take(q, "holder", "t", 1.0, 5, 1, None, None)
    loop = asyncio.get_running_loop()
    with pytest.raises(GatewayError) as info:
        await clients.take(q, "late", "t", 1.0, 5, 1, loop.time() + 0.05, None)
    assert info.value.status == 504 and info.value.code == "deadline_exceeded"
    assert q.size == 0 and set(q.policy.slots) == {"holder"}


async def test_leaving_while_queued_removes_the_entry_and_a_late_grant_is_returned(clients: Clients) -> None:
    q = make()
    await clients.take(q, "holder", "t", 1.0, 5, 1, None, None)
    w = asyncio.ensure_future(clients.take(q, "w", "t", 1.0, 5, 1, None, None))
    await settle()
    w.cancel()
    await settle()
    assert q.size == 0
    clients.release("holder")
    await settle()
    assert not q.policy.slots and await q.slots.gate.in_flight("m") == (0, 0)


async def test_an_upstream_without_limits_has_no_gate_round_trip(clients: Clients) -> None:
    q = make(cap_seqs=None, cap_tokens=None)
    for i in range(5):
        assert await clients.take(q, f"r{i}", "t", 1.0, 5, 10**6, None, None) == 0.0
    assert await q.slots.gate.in_flight("m") == (0, 0)  # the shared gate was never asked
    assert len(q.policy.slots) == 5
    for i in range(5):
        clients.release(f"r{i}")
    await settle()
    assert not q.policy.slots and q.snapshot().drain_rate is not None


async def test_the_reserve_keeps_room_for_urgent_requests(clients: Clients) -> None:
    # 4 sequences; half is reserved for priority <= 1
    q = make(cap_seqs=4, reserve_share=0.5, reserve_priority=1)
    for i in range(2):  # batch fills its share at once
        assert await clients.take(q, f"b{i}", "t", 1.0, 5, 1, None, None) == 0.0
    third = asyncio.ensure_future(clients.take(q, "b2", "t", 1.0, 5, 1, None, None))
    await settle()
    assert not third.done() and q.size == 1  # the batch request waits: its share is full
    # an urgent request arriving behind it goes past, into the reserve
    assert await asyncio.wait_for(clients.take(q, "u0", "t", 1.0, 0, 1, None, None), 1) >= 0
    assert await asyncio.wait_for(clients.take(q, "u1", "t", 1.0, 1, 1, None, None), 1) >= 0
    assert not third.done()
    # the upstream is full now: an urgent one waits too, and goes first when a slot frees
    urgent = asyncio.ensure_future(clients.take(q, "u2", "t", 1.0, 0, 1, None, None))
    await settle()
    clients.release("u0")
    await asyncio.wait_for(urgent, 1)
    assert not third.done()
    # batch starts again only once the upstream is back under its share (2 of 4 in flight)
    clients.release("b0")
    clients.release("u1")
    await settle()
    assert not third.done()  # b1 and u2 still hold 2
    clients.release("u2")
    await asyncio.wait_for(third, 1)
    await q.aclose()


async def test_without_a_reserve_batch_may_take_every_slot(clients: Clients) -> None:
    q = make(cap_seqs=4)
    for i in range(4):
        assert await clients.take(q, f"b{i}", "t", 1.0, 5, 1, None, None) == 0.0
    await q.aclose()


async def test_the_reserve_applies_to_kv_tokens_too(clients: Clients) -> None:
    q = make(cap_seqs=None, cap_tokens=1000, reserve_share=0.25, reserve_priority=0)
    assert await clients.take(q, "b0", "t", 1.0, 3, 700, None, None) == 0.0
    waiting = asyncio.ensure_future(clients.take(q, "b1", "t", 1.0, 3, 100, None, None))
    await settle()
    assert not waiting.done()  # 800 > 750, the batch share of the tokens
    assert await asyncio.wait_for(clients.take(q, "u0", "t", 1.0, 0, 300, None, None), 1) >= 0
    waiting.cancel()
    await q.aclose()


# ---- snapshot() and the slot() / early() stages --------------------------------------------
def req(rid: str, tenant: str = "t", tokens: int = 10, priority: int = 5,
        deadline: float | None = None) -> SlotRequest:
    return SlotRequest(rid, tenant, 1.0, priority, tokens, deadline, None)


async def until(cond: Callable[[], bool], timeout_s: float = 2.0) -> None:
    """Poll ``cond`` until it holds, failing after ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.001)


async def empty(q: DispatchQueue, *pending: asyncio.Future[Any]) -> bool:
    """Once ``pending`` (early gate calls) are done: nothing held by this replica, nothing
    in flight at the gate."""
    await until(lambda: all(f.done() for f in pending) and not q.policy.slots)
    q.check_invariants()
    return await q.slots.gate.in_flight("m") == (0, 0)


class BlockGate(MemoryGate):
    """A gate whose acquire waits until ``opened``, and that can run a hook on a grant."""

    def __init__(self) -> None:
        super().__init__()
        self.opened = asyncio.Event()
        self.opened.set()
        self.asked: list[str] = []
        self.answered: list[str] = []
        self.on_grant: Callable[[str], object] | None = None

    async def acquire(self, upstream: str, request_id: str, tokens: int,
                      cap_tokens: int | None, cap_seqs: int | None, ttl_s: float) -> bool:
        self.asked.append(request_id)
        await self.opened.wait()
        ok = await super().acquire(upstream, request_id, tokens, cap_tokens, cap_seqs, ttl_s)
        self.answered.append(request_id)
        if ok and self.on_grant is not None:
            self.on_grant(request_id)
        return ok


def gated(gate: BlockGate, **kw: Any) -> DispatchQueue:
    opts: dict[str, Any] = {"max_len": 1000, "aging_s": 5.0, "slot_ttl_s": 30.0, **kw}
    return DispatchQueue("m", gate, lambda: (None, 1), **opts)


async def test_snapshot_has_what_metrics_and_load_read(clients: Clients) -> None:
    q = make()
    await clients.take(q, "holder", "x", 1.0, 5, 7, None, None)
    w1 = asyncio.ensure_future(clients.take(q, "w1", "u", 1.0, 5, 5, None, None))
    w2 = asyncio.ensure_future(clients.take(q, "w2", "v", 1.0, 5, 3, None, None))
    await settle()
    q.check_invariants()
    snap = q.snapshot()
    assert snap == QueueSnapshot("m", size=2, waiting_tokens=8, slots_held=1, held_tokens=7,
                                 dispatched=(), drain_rate=None)
    assert q.load_tokens() == 7 + 8  # what the router reads per request, cheaply
    clients.release("holder")
    await asyncio.wait_for(w1, 2)
    snap = q.snapshot()
    assert (snap.size, snap.waiting_tokens, snap.slots_held, snap.held_tokens) == (1, 3, 1, 5)
    assert snap.dispatched == (("u", 1),) and snap.drain_rate is not None
    assert q.load_tokens() == 5 + 3
    with pytest.raises(AttributeError):
        snap.size = 0  # type: ignore[misc]  # frozen: the failing assignment is the test
    w2.cancel()


async def test_slot_releases_the_worst_case_however_the_block_ends() -> None:
    clock = Clock()
    q = make(clock=clock)
    with pytest.raises(RuntimeError):
        async with q.slot(req("r1", tokens=40)) as slot:
            assert slot.waited_s == 0.0 and set(q.policy.slots) == {"r1"}
            slot.release()  # early, e.g. before a retry on another server ...
            raise RuntimeError("upstream failed")
    assert await empty(q)  # ... and only once
    assert q.snapshot().drain_rate == pytest.approx(40.0)  # released with its worst case, not 0


async def test_slot_waits_and_reports_the_wait() -> None:
    clock = Clock()
    q = make(clock=clock)
    async with q.slot(req("holder")):
        got: list[Slot] = []

        async def waiter() -> None:
            async with q.slot(req("w")) as slot:
                got.append(slot)

        task = asyncio.ensure_future(waiter())
        await until(lambda: q.size == 1)
        clock.now += 3.0
    await asyncio.wait_for(task, 2)
    assert got[0].waited_s == pytest.approx(3.0)
    assert await empty(q)


async def test_leaving_slot_while_waiting_removes_it_at_once() -> None:
    q = make()
    ran = False
    async with q.slot(req("holder")):
        async def waiter() -> None:
            nonlocal ran
            async with q.slot(req("w")):
                ran = True

        task = asyncio.ensure_future(waiter())
        await until(lambda: q.size == 1)
        task.cancel()
        await until(lambda: q.size == 0)
        assert set(q.policy.slots) == {"holder"}
        q.check_invariants()
    assert await empty(q) and not ran and task.cancelled()


async def test_leaving_slot_just_as_it_is_granted_gives_it_back() -> None:
    gate = BlockGate()
    q = gated(gate)
    ran = False

    async def waiter() -> None:
        nonlocal ran
        async with q.slot(req("w")):
            ran = True

    async with q.slot(req("holder")):
        task = asyncio.ensure_future(waiter())
        await until(lambda: q.size == 1)
        # the cancel lands after the grant, before the waiter wakes to it
        gate.on_grant = lambda rid: asyncio.get_running_loop().call_soon(task.cancel)
    await until(task.done)
    assert task.cancelled() and not ran
    assert await empty(q)
    # and leaving while the pump's gate call for it is in flight
    gate.on_grant = None
    async with q.slot(req("holder2")):
        task = asyncio.ensure_future(waiter())
        await until(lambda: q.size == 1)
        gate.opened.clear()  # the pump's next gate call for w hangs
        asked = len(gate.asked)
    await until(lambda: len(gate.asked) > asked and not q.policy.slots)
    task.cancel()
    await until(lambda: q.size == 0)  # removed at once, the gate call still pending
    assert task.cancelled()
    answered = len(gate.answered)
    gate.opened.set()
    await until(lambda: len(gate.answered) > answered)  # granted to nobody: given back
    assert gate.answered[-1] == "w" and not ran and await empty(q)
    await q.aclose()


async def test_slot_takes_the_early_slot() -> None:
    q = make()
    r = req("r", tokens=20)
    async with q.early(r) as early:
        assert early is not None
        async with q.slot(r, early) as slot:
            assert early.consumed and slot.waited_s == 0.0 and set(q.policy.slots) == {"r"}
        assert early.consumed
    assert await empty(q)
    assert q.snapshot().drain_rate == pytest.approx(20.0)  # slot() released it, with its worst case


async def test_the_early_slot_is_given_back_when_the_request_will_not_run(
        clients: Clients) -> None:
    q = make()
    pending: list[asyncio.Task[bool]] = []
    # the reservation is refused before the early gate call even ran
    with pytest.raises(GatewayError):
        async with q.early(req("r1")) as early:
            assert early is not None and not early.task.done()
            pending.append(early.task)
            raise GatewayError("quota")
    assert await empty(q, *pending)
    # ... or after it got the slot
    with pytest.raises(GatewayError):
        async with q.early(req("r2")) as early:
            assert early is not None and await early.granted()
            pending.append(early.task)
            raise GatewayError("quota")
    assert await empty(q, *pending)
    # nothing is asked early while requests wait; slot() queues as usual
    async with q.slot(req("holder")):
        w = asyncio.ensure_future(clients.take(q, "w", "t", 1.0, 5, 1, None, None))
        await until(lambda: q.size == 1)
        async with q.early(req("r3")) as early:
            assert early is None
        w.cancel()
    assert await empty(q)


async def test_cancelled_mid_early_gives_the_slot_back_when_the_gate_answers() -> None:
    gate = BlockGate()
    q = gated(gate)
    attempts: list[EarlyAttempt] = []
    reached = asyncio.Event()
    ran = False

    async def request(take: bool) -> None:
        nonlocal ran
        r = req("r")
        async with q.early(r) as early:
            assert early is not None
            attempts.append(early)
            reached.set()
            if not take:
                await asyncio.Event().wait()  # the reservation, cancelled
            async with q.slot(r, early):  # waits on the early gate call, cancelled
                ran = True

    for take in (False, True):
        reached.clear()
        gate.opened.clear()
        gate.asked.clear()
        task = asyncio.ensure_future(request(take))
        await until(lambda: reached.is_set() and gate.asked == ["r"])
        task.cancel()
        await until(task.done)
        assert task.cancelled() and not q.policy.slots and not attempts[-1].task.done()
        gate.opened.set()  # the early call lands now: its slot goes straight back
        assert await empty(q, attempts[-1].task)
        assert not attempts[-1].consumed
    assert not ran


async def test_an_early_attempt_that_got_nothing_queues() -> None:
    q = make()
    async with q.slot(req("holder")), q.early(req("r")) as early:
        assert early is not None and not await early.granted()  # full

        async def take() -> Slot:
            async with q.slot(req("r"), early) as slot:
                return slot

        task = asyncio.ensure_future(take())
        await until(lambda: q.size == 1)
    slot = await asyncio.wait_for(task, 2)
    assert slot.released and not early.consumed  # a slot from the queue, given back
    assert await empty(q)
