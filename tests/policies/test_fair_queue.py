"""The fair queue's policy on a fake clock: order, aging, fair share, reserve, shedding and
the drain estimate, with no loop and no gate."""

from __future__ import annotations

import pytest

from policies.fair_queue import DEFAULT_RETRY_S, Entry, FairQueue, Reserve, ShedReason


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock | None = None, **kw: float) -> tuple[FairQueue, Clock]:
    clock = clock or Clock()
    opts = {"max_len": 1000, "aging_s": 5.0, **kw}
    return FairQueue(max_len=int(opts["max_len"]), aging_s=opts["aging_s"], clock=clock), clock


def drain(q: FairQueue, n: int | None = None) -> list[str]:
    """Dispatch the pick ``n`` times (all, by default); returns the ids in order."""
    order: list[str] = []
    while q.size and (n is None or len(order) < n):
        e = q.pick()
        assert e is not None
        q.dispatch(e)
        q.check_invariants()
        order.append(e.request_id)
    return order


def test_priority_first_then_arrival() -> None:
    q, clock = make()
    q.push("low", "t", 1.0, 5, 1, clock())
    clock.now += 1
    q.push("high", "t", 1.0, 0, 1, clock())
    q.push("high2", "t", 1.0, 0, 1, clock())
    assert drain(q) == ["high", "high2", "low"]


def test_aging_moves_a_low_priority_request_ahead_of_newer_urgent_ones() -> None:
    q, clock = make(aging_s=1.0)
    q.push("low", "t", 1.0, 3, 1, clock())
    clock.now += 2.5  # low's class is 3 - 2 = 1
    q.push("p1", "u", 1.0, 1, 1, clock())  # same class, but u's virtual time is level: arrival
    q.push("p0", "u", 1.0, 0, 1, clock())
    assert q.urgency(q.waiting[("t", 3)][0], clock()) == 1
    assert drain(q, 1) == ["p0"]
    clock.now += 0.6  # low's class is 0 now, p1's still 1
    assert drain(q) == ["low", "p1"]


def test_a_flooding_tenant_does_not_starve_a_newcomer_and_banks_no_credit() -> None:
    q, clock = make()
    for i in range(40):
        q.push(f"a{i}", "a", 1.0, 5, 1, clock())
    assert drain(q, 10) == [f"a{i}" for i in range(10)]
    # b arrives later, starting level with a (whose virtual time is 10), not at 0
    for i in range(10):
        q.push(f"b{i}", "b", 1.0, 5, 1, clock())
    assert q.vtime["b"] == q.vtime["a"] == 10.0
    nxt = drain(q, 20)
    assert sum(r.startswith("b") for r in nxt) == 10


def test_a_tenant_back_from_idle_banks_no_credit() -> None:
    q, clock = make()
    for i in range(20):
        q.push(f"a{i}", "a", 1.0, 5, 1, clock())
    q.push("b0", "b", 1.0, 5, 1, clock())
    assert drain(q, 12).count("b0") == 1  # b is served once, then idles
    assert q.vtime["b"] == 1.0 and q.vtime["a"] == 11.0
    for i in range(5):
        q.push(f"b{i + 1}", "b", 1.0, 5, 1, clock())
    assert q.vtime["b"] == 11.0  # level with a, which still waits: not at 1
    # alternating (ties to the FIFO that waited first), not five b in a row
    assert drain(q, 6) == ["a11", "b1", "a12", "b2", "a13", "b3"]


def test_weights_set_the_share() -> None:
    q, clock = make()
    for i in range(40):
        q.push(f"a{i}", "a", 3.0, 5, 1, clock())
        q.push(f"b{i}", "b", 1.0, 5, 1, clock())
    first = drain(q, 40)
    assert sum(r.startswith("a") for r in first) == 30
    assert q.dispatched == {"a": 30, "b": 10}


def test_remove_is_idempotent_and_keeps_counts() -> None:
    q, clock = make()
    e = q.push("r", "t", 1.0, 5, 7, clock())
    q.push("s", "t", 1.0, 5, 3, clock())
    assert q.waiting_tokens == 10 and q.waiting_of("t") == 2
    assert q.remove(e) and not q.remove(e)
    assert q.size == 1 and q.waiting_of("t") == 1 and q.waiting_tokens == 3
    q.check_invariants()


def test_pick_skips_ineligible_heads() -> None:
    q, clock = make()
    q.push("batch", "t", 1.0, 5, 1, clock())
    q.push("urgent", "u", 1.0, 1, 1, clock())
    reserve = Reserve(0.5, 1)
    first = q.pick()
    assert first is not None and first.request_id == "urgent"
    only_batch = q.pick(lambda e: not reserve.urgent(e.priority))
    assert only_batch is not None and only_batch.request_id == "batch"
    assert q.pick(lambda e: False) is None


def test_reserve_caps_batch_only() -> None:
    r = Reserve(0.25, 2)
    assert r.urgent(2) and not r.urgent(3)
    assert r.caps(2, 1000, 8) == (1000, 8)
    assert r.caps(3, 1000, 8) == (750, 6)
    assert r.caps(3, None, 1) == (None, 1)  # never below one
    assert Reserve().caps(9, 1000, 8) == (1000, 8)


def test_drain_rate_over_the_window_and_since_the_first_slot() -> None:
    q, clock = make()
    assert q.drain_rate() is None
    q.grant("r1", 100)
    q.grant("r2", 50)
    assert q.held_tokens == 150 and q.drain_rate() is None  # nothing released yet
    clock.now += 0.5
    assert q.release("r1", 100) and not q.release("r1", 100)
    assert q.drain_rate() == pytest.approx(100.0)  # over at least 1 s
    clock.now += 3.5
    assert q.drain_rate() == pytest.approx(25.0)  # 100 over the 4 s since the first slot
    clock.now += 20
    assert q.drain_rate() is None  # released before the window
    q.release("r2", 0)
    assert q.drain_rate() is None  # given back unused: no rate
    q.check_invariants()


def test_shedding_by_length_max_queued_and_predicted_wait() -> None:
    q, clock = make(max_len=3)
    # no rate yet: nothing shed by prediction, Retry-After is the default
    q.push("w0", "t", 1.0, 5, 100, clock())
    assert q.shed("t", 5, 100, None, clock() + 0.001, clock()) is None
    shed = q.shed("t", 5, 100, 1, None, clock())
    assert shed is not None and shed.reason is ShedReason.MAX_QUEUED
    assert shed.retry_after_s == DEFAULT_RETRY_S and shed.predicted_wait_s is None
    q.grant("h", 100)
    clock.now += 10
    q.release("h", 100)  # 10 tokens/s
    q.push("w1", "u", 1.0, 9, 100, clock())  # less urgent: not ahead of a priority-5 request
    assert q.predicted_wait(5, 100) == pytest.approx(20.0)
    assert q.shed("v", 5, 100, None, clock() + 20.0, clock()) is None
    late = q.shed("v", 5, 100, None, clock() + 19.0, clock())
    assert late is not None and late.reason is ShedReason.DEADLINE
    assert late.retry_after_s == pytest.approx(20.0)
    q.push("w2", "u", 1.0, 9, 100, clock())
    full = q.shed("v", 0, 1, None, None, clock())
    assert full is not None and full.reason is ShedReason.FULL


def test_check_invariants_catches_disagreeing_counts() -> None:
    q, clock = make()
    q.push("r", "t", 1.0, 5, 1, clock())
    q.check_invariants()
    q._size += 1  # corrupt on purpose
    with pytest.raises(AssertionError, match="size"):
        q.check_invariants()
    q._size -= 1
    q._waiting[("t", 5)].append(Entry("x", "other", 1.0, 5, 1, clock()))
    with pytest.raises(AssertionError, match="filed under"):
        q.check_invariants()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        FairQueue(max_len=1, aging_s=0, clock=Clock())
    q, clock = make()
    with pytest.raises(ValueError):
        q.push("r", "t", 0.0, 5, 1, clock())
