"""Property-based test of the fair queue's policy against a shadow model, on a fake clock.

The shadow keeps every waiting request in one flat list and recomputes, from the rules in
``policies/fair_queue.py``'s docstring, what the queue should answer: the pick (least class,
then virtual time, then arrival; FIFO within a tenant and priority), the virtual times (a
newcomer starts at the least of those waiting, a dispatch costs ``1 / weight``), the drain
rate over the window, the predicted wait and the shed decision. Random streams of arrivals,
departures, dispatches, early grants, releases and clock ticks must agree with it at every
step, and leave nobody waiting forever.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.fair_queue import DEFAULT_RETRY_S, MIN_RETRY_S, Entry, FairQueue, Reserve, ShedReason

TENANTS = ["a", "b", "c"]
P_MIN, P_MAX = 0, 3
AGING = 1.0
WINDOW = 10.0
RESERVE = Reserve(0.5, 1)


def close(x: float | None, y: float | None) -> bool:
    if x is None or y is None:
        return x is y
    return math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9)


@dataclass
class Want:
    seq: int
    rid: str
    tenant: str
    priority: int
    tokens: int
    arrival: float


class Harness:
    def __init__(self, weights: list[float], max_len: int) -> None:
        self.now = 0.0
        self.q = FairQueue(max_len=max_len, aging_s=AGING, clock=lambda: self.now,
                           drain_window_s=WINDOW)
        self.weights = dict(zip(TENANTS, weights, strict=True))
        self.entries: dict[str, Entry] = {}  # rid -> the queue's entry
        self.waiting: list[Want] = []
        self.vtime: dict[str, float] = {}
        self.dispatched: dict[str, int] = {}
        self.fifo_since: dict[tuple[str, int], int] = {}  # when the FIFO last became non-empty
        self.slots: dict[str, int] = {}
        self.releases: list[tuple[float, int]] = []
        self.first_slot: float | None = None
        self.n = 0

    # ---- the shadow's rules ---------------------------------------------------------------
    def cls(self, w: Want) -> int:
        return w.priority - math.floor((self.now - w.arrival) / AGING)

    def key(self, w: Want) -> tuple[int, float, float]:
        return self.cls(w), self.vtime[w.tenant], w.arrival

    def rate(self) -> float | None:
        recent = [n for t, n in self.releases if t >= self.now - WINDOW]
        if not recent or self.first_slot is None or sum(recent) <= 0:
            return None
        return sum(recent) / max(min(self.now - self.first_slot, WINDOW), 1.0)

    def wait(self, priority: int, tokens: int) -> float | None:
        rate = self.rate()
        if rate is None:
            return None
        ahead = sum(w.tokens for w in self.waiting if self.cls(w) <= priority)
        return (ahead + tokens) / rate

    def grant(self, rid: str, tokens: int) -> None:
        self.q.grant(rid, tokens)
        self.slots[rid] = tokens
        if self.first_slot is None:
            self.first_slot = self.now

    # ---- operations -----------------------------------------------------------------------
    def push(self, t: int, priority: int, tokens: int) -> None:
        tenant = TENANTS[t]
        self.n += 1
        rid = f"r{self.n}"
        if not any(w.tenant == tenant for w in self.waiting):
            active = {w.tenant for w in self.waiting}
            floor = min((self.vtime[x] for x in active), default=0.0)
            self.vtime[tenant] = max(self.vtime.get(tenant, 0.0), floor)
        if not any((w.tenant, w.priority) == (tenant, priority) for w in self.waiting):
            self.fifo_since[(tenant, priority)] = self.n
        self.entries[rid] = self.q.push(rid, tenant, self.weights[tenant], priority, tokens,
                                        self.now)
        self.waiting.append(Want(self.n, rid, tenant, priority, tokens, self.now))

    def leave(self, index: int) -> None:
        if self.waiting:
            w = self.waiting.pop(index % len(self.waiting))
            assert self.q.remove(self.entries.pop(w.rid))

    def dispatch(self, mode: str) -> None:
        if mode == "urgent":
            def ok(priority: int, tenant: str) -> bool:
                return RESERVE.urgent(priority)
        elif mode == "not_a":
            def ok(priority: int, tenant: str) -> bool:
                return tenant != "a"
        else:
            def ok(priority: int, tenant: str) -> bool:
                return True
        got = self.q.pick(lambda e: ok(e.priority, e.tenant))
        eligible = [w for w in self.waiting if ok(w.priority, w.tenant)]
        if not eligible:
            assert got is None
            return
        assert got is not None
        w = next(x for x in self.waiting if x.rid == got.request_id)
        # the most urgent class, within it the least virtual time, then the earliest
        best = min(self.key(x) for x in eligible)
        assert self.key(w) == best, (w, eligible)
        # ties go to the FIFO that started waiting first (deterministic)
        assert self.fifo_since[(w.tenant, w.priority)] == min(
            self.fifo_since[(x.tenant, x.priority)] for x in eligible if self.key(x) == best)
        # FIFO within a tenant and priority
        assert w.seq == min(x.seq for x in self.waiting
                            if (x.tenant, x.priority) == (w.tenant, w.priority))
        # no starvation: whoever waited long enough goes before a later arrival
        for x in eligible:
            assert not x.arrival + (x.priority - P_MIN + 1) * AGING <= w.arrival, (x, w)
        self.q.dispatch(got)
        self.waiting.remove(w)
        del self.entries[w.rid]
        self.vtime[w.tenant] += 1.0 / self.weights[w.tenant]
        self.dispatched[w.tenant] = self.dispatched.get(w.tenant, 0) + 1
        self.grant(w.rid, w.tokens)

    def early(self, tokens: int) -> None:
        self.n += 1
        self.grant(f"early{self.n}", tokens)

    def regrant(self, index: int, tokens: int) -> None:
        """The gate grants a slot this replica holds already (a retry of the same id)."""
        if self.slots:
            self.grant(sorted(self.slots)[index % len(self.slots)], tokens)

    def release(self, index: int, used: bool) -> None:
        if not self.slots:
            assert not self.q.release("never-held", 5)
            return
        rid = sorted(self.slots)[index % len(self.slots)]
        tokens = self.slots.pop(rid) if used else 0
        self.slots.pop(rid, None)
        assert self.q.release(rid, tokens)
        assert not self.q.release(rid, tokens)  # idempotent
        self.releases.append((self.now, tokens))

    def shed(self, t: int, priority: int, tokens: int, max_queued: int | None,
             deadline_in: float | None) -> None:
        tenant = TENANTS[t]
        deadline = None if deadline_in is None else self.now + deadline_in
        got = self.q.shed(tenant, priority, tokens, max_queued, deadline, self.now)
        wait = self.wait(priority, tokens)
        retry = DEFAULT_RETRY_S if wait is None else max(wait, MIN_RETRY_S)
        if len(self.waiting) >= self.q.max_len:
            want: ShedReason | None = ShedReason.FULL
        elif max_queued is not None and \
                sum(w.tenant == tenant for w in self.waiting) >= max_queued:
            want = ShedReason.MAX_QUEUED
        elif deadline is not None and wait is not None and self.now + wait > deadline:
            want = ShedReason.DEADLINE
        else:
            want = None
        assert (None if got is None else got.reason) is want
        if got is not None:
            assert close(got.retry_after_s, retry) and close(got.predicted_wait_s, wait)

    def check(self) -> None:
        q = self.q
        q.check_invariants()
        assert q.size == len(self.waiting)
        for tenant in TENANTS:
            assert q.waiting_of(tenant) == sum(w.tenant == tenant for w in self.waiting)
        assert q.waiting_tokens == sum(w.tokens for w in self.waiting)
        assert dict(q.slots) == self.slots and q.held_tokens == sum(self.slots.values())
        assert dict(q.dispatched) == self.dispatched
        for tenant, v in self.vtime.items():
            assert close(q.vtime[tenant], v), (tenant, q.vtime[tenant], v)
        assert close(q.drain_rate(), self.rate())
        for priority in range(P_MIN, P_MAX + 1):
            assert close(q.predicted_wait(priority, 10), self.wait(priority, 10))


push_st = st.tuples(st.just("push"), st.integers(0, 2), st.integers(P_MIN, P_MAX),
                   st.integers(1, 50))
tick_st = st.tuples(st.just("tick"), st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.5, 7.0, 10.25]))
op_st = st.one_of(
    push_st, push_st, push_st, tick_st, tick_st,
    st.tuples(st.just("dispatch"), st.sampled_from(["any", "any", "urgent", "not_a"])),
    st.tuples(st.just("dispatch"), st.just("any")),
    st.tuples(st.just("leave"), st.integers(0, 50)),
    st.tuples(st.just("early"), st.integers(0, 50)),
    st.tuples(st.just("regrant"), st.integers(0, 50), st.integers(0, 50)),
    st.tuples(st.just("release"), st.integers(0, 50), st.booleans()),
    st.tuples(st.just("shed"), st.integers(0, 2), st.integers(P_MIN, P_MAX),
              st.integers(1, 50), st.one_of(st.none(), st.integers(0, 4)),
              st.one_of(st.none(), st.sampled_from([0.0, 0.5, 2.0, 10.0, 60.0]))),
)
weights_st = st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=3, max_size=3)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op_st, min_size=10, max_size=120), weights=weights_st,
       max_len=st.sampled_from([0, 2, 5, 12, 100]))
def test_random_streams_agree_with_the_shadow(ops: list[tuple[object, ...]],
                                              weights: list[float], max_len: int) -> None:
    h = Harness(weights, max_len)
    for op in ops:
        match op:
            case ("push", int(tenant), int(priority), int(tokens)):
                if len(h.waiting) < max_len:  # the wrapper asks shed() first
                    h.push(tenant, priority, tokens)
            case ("tick", float(dt)):
                h.now += dt
            case (str(kind), *args):
                getattr(h, kind)(*args)
        h.check()
    # Everybody is served in the end (a bounded number of dispatches), and all slots return.
    for _ in range(200):
        if not h.waiting:
            break
        h.now += 0.5
        h.dispatch("any")
        h.check()
    assert not h.waiting and h.q.size == 0
    while h.slots:
        h.release(0, True)
        h.check()
    assert h.q.held_tokens == 0


@settings(max_examples=200, deadline=None)
@given(weights=st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0, 5.0]), min_size=2, max_size=4),
       order=st.randoms(use_true_random=False), backlog=st.integers(5, 30))
def test_backlogged_tenants_get_their_weighted_share(weights: list[float],
                                                     order: random.Random,
                                                     backlog: int) -> None:
    now = 0.0
    q = FairQueue(max_len=1000, aging_s=AGING, clock=lambda: now)
    tenants = [f"t{i}" for i in range(len(weights))]
    pushes = [t for t in tenants for _ in range(backlog)]
    order.shuffle(pushes)
    for n, t in enumerate(pushes):
        q.push(f"{t}-{n}", t, weights[tenants.index(t)], 2, 1, now)
    count = dict.fromkeys(tenants, 0)
    # while every tenant stays backlogged, dispatches/weight stay within one dispatch's
    # cost of each other: v_i - 1/w_i <= v_j
    for _ in range(backlog):
        e = q.pick()
        assert e is not None
        q.dispatch(e)
        count[e.tenant] += 1
        if min(q.waiting_of(t) for t in tenants) == 0:
            break
        v = {t: count[t] / weights[i] for i, t in enumerate(tenants)}
        for i, ti in enumerate(tenants):
            for tj in tenants:
                assert v[ti] - 1.0 / weights[i] <= v[tj] + 1e-9, (count, weights)
    q.check_invariants()
