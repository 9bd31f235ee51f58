"""A replica's slots at the capacity gate: fail closed (and undo an acquire that may have
landed), fail open on this replica's share, no gate for an upstream of unknown capacity,
renewals, releases in owned tasks."""

from __future__ import annotations

from typing import Any

import pytest

from gateway import slots as slots_module
from gateway.errors import ServiceUnavailable
from gateway.slots import HeldSlots, Limits
from policies.capacity import MemoryGate
from policies.fair_queue import FairQueue, Reserve
from policies.store import StoreError, StoreUnavailable


class FlakyGate(MemoryGate):
    """A gate that can be down: ``acquire`` raises, after taking the slot when ``lands``
    (a call that timed out but reached Redis); renewals are counted."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.lands = False
        self.renewed: list[str] = []
        self.calls = 0  # renew_many calls: one round trip each in Redis
        self.odd = False  # renewals get an answer nobody expected (StoreError)

    async def acquire(self, upstream: str, request_id: str, tokens: int,
                      cap_tokens: int | None, cap_seqs: int | None, ttl_s: float) -> bool:
        if self.down and not self.lands:
            raise StoreUnavailable("down")
        ok = await super().acquire(upstream, request_id, tokens, cap_tokens, cap_seqs, ttl_s)
        if self.down:
            raise StoreUnavailable("timed out")
        return ok

    async def renew_many(self, upstream: str, request_ids: Any, ttl_s: float) -> list[bool]:
        self.renewed += request_ids
        self.calls += 1
        if self.down:
            raise StoreUnavailable("down")
        if self.odd:
            raise StoreError("unexpected answer")
        return await super().renew_many(upstream, request_ids, ttl_s)


def held(gate: FlakyGate, limits: Limits = lambda: (None, 4), replicas: int = 2,
         freed: list[str] | None = None) -> HeldSlots:
    policy = FairQueue(max_len=10, aging_s=5.0, clock=lambda: 0.0)
    sink = [] if freed is None else freed
    return HeldSlots("m", gate, limits, Reserve(), policy, lambda: sink.append("freed"),
                     ttl_s=30.0, replicas=replicas)


async def test_an_unreachable_gate_fails_closed_and_undoes_a_landed_acquire() -> None:
    gate = FlakyGate()
    gate.down = gate.lands = True
    s = held(gate)
    with pytest.raises(ServiceUnavailable) as err:
        await s.acquire("r", 1, 5, fail_open=False)
    assert err.value.code == "store_unavailable" and err.value.retry_after_s is not None
    assert await gate.in_flight("m") == (1, 1)  # it landed ...
    await s.aclose()
    assert await gate.in_flight("m") == (0, 0)  # ... and was undone
    assert len(s) == 0 and not s.policy.slots


async def test_fail_open_uses_this_replicas_share_on_the_local_gate(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slots_module, "UNDO_AGAIN_S", 0.0)
    gate = FlakyGate()
    gate.down = True
    freed: list[str] = []
    s = held(gate, freed=freed)  # 4 sequences over 2 replicas: 2 here
    assert [await s.acquire(f"r{i}", 1, 5, fail_open=True) for i in range(3)] == \
        [True, True, False]
    assert set(s) == set(s.policy.slots) == {"r0", "r1"}
    assert await s.local_gate.in_flight("m") == (2, 2)
    s.release("r0", 1)
    s.release("r0", 1)  # once only
    await s.aclose()
    assert set(s) == {"r1"} and freed == ["freed"]
    assert await s.local_gate.in_flight("m") == (1, 1)


async def test_an_upstream_without_limits_has_no_gate() -> None:
    gate = FlakyGate()
    freed: list[str] = []
    s = held(gate, limits=lambda: (None, None), freed=freed)
    assert await s.acquire("r", 10**6, 5, fail_open=False)
    assert await gate.in_flight("m") == (0, 0) and s.policy.held_tokens == 10**6
    await s.renew_all()
    assert gate.renewed == []  # nothing to renew at a gate
    s.release("r", 10)
    await s.aclose()
    assert len(s) == 0 and freed == ["freed"]


async def test_renewals_survive_an_unreachable_gate() -> None:
    gate = FlakyGate()
    s = held(gate)
    assert await s.acquire("a", 1, 5, fail_open=False)
    assert await s.acquire("b", 1, 5, fail_open=False)
    gate.down = True
    await s.renew_all()  # StoreUnavailable swallowed: the next round retries
    assert gate.renewed == ["a", "b"] and gate.calls == 1  # one call for the beat


async def test_an_odd_answer_fails_one_batch_not_the_beat(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slots_module, "RENEW_BATCH", 1)
    gate = FlakyGate()
    s = held(gate)
    assert await s.acquire("a", 1, 5, fail_open=False)
    assert await s.acquire("b", 1, 5, fail_open=False)
    gate.odd = True
    await s.renew_all()  # logged, not raised: the renewal loop lives on
    assert gate.renewed == ["a", "b"] and gate.calls == 2  # the second batch still tried
