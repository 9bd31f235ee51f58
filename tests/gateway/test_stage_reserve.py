"""The reserve stage alone: ``async with reservation as ticket`` over the in-memory store.
The grant, the refusal, the settlement at what was used however the block ends, and a
client leaving in the middle of the grant (the store call lands later: settled at zero)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from gateway.admission import Admission
from gateway.errors import GatewayError
from gateway.tenants import Tenant
from policies.memory import MemoryStore
from tests.gateway.stage_kit import Spans, config
from tests.gateway.stage_kit import quota_tenant as tenant


class SlowStore(MemoryStore):
    """A store whose reserve waits for ``go`` (a slow Redis)."""

    def __init__(self) -> None:
        super().__init__()
        self.go = asyncio.Event()
        self.called = asyncio.Event()

    async def reserve(self, *args: Any, **kwargs: Any) -> Any:
        self.called.set()
        await self.go.wait()
        return await super().reserve(*args, **kwargs)


async def settled(adm: Admission) -> None:
    """Settlements run in tasks the admission owns: wait for them."""
    while adm._settling:
        await asyncio.wait(adm._settling)


async def usage(adm: Admission, who: Tenant) -> dict[str, Any]:
    await settled(adm)
    return dict(await adm.store.usage(who.id))


async def test_granted_then_settled_at_what_was_used() -> None:
    adm, who, spans = Admission(config()), tenant(), Spans()
    reservation = adm.reserve(who, "r1", 100, spans)
    async with reservation as ticket:
        assert ticket.tokens == 100 and "r1" in adm.live
        assert (await adm.store.usage(who.id))["reserved"]["day"] == 100
        reservation.settle_at(7, 5)
    u = await usage(adm, who)
    assert not adm.live and u["concurrency"] == 0
    assert u["reserved"]["day"] == 0 and u["settled"]["day"] == 12
    assert spans.named("sluice.admission.reserve") == [
        {"sluice.reserved_tokens": 100, "sluice.granted": True, "sluice.fail_open": False}]
    # settling is an event on the request span, not a phase span
    assert spans.events == [("sluice.settle", {"gen_ai.usage.input_tokens": 7,
                                               "gen_ai.usage.output_tokens": 5})]
    assert [n for n, _ in spans.ended] == ["sluice.admission.reserve"]


async def test_a_block_that_raises_still_settles() -> None:
    adm, who = Admission(config()), tenant()
    reservation = adm.reserve(who, "r2", 100)
    with pytest.raises(RuntimeError):
        async with reservation:
            reservation.settle_at(3, 0)
            raise RuntimeError("the relay failed")
    u = await usage(adm, who)
    assert not adm.live and u["settled"]["day"] == 3 and u["reserved"]["day"] == 0


async def test_a_refusal_holds_nothing() -> None:
    adm, who, spans = Admission(config()), tenant(tokens_per_minute=50), Spans()
    with pytest.raises(GatewayError) as refused:
        async with adm.reserve(who, "r3", 100, spans):
            raise AssertionError("not granted")
    assert refused.value.status == 429 and refused.value.param == "tokens_per_minute"
    u = await usage(adm, who)
    assert not adm.live and u["concurrency"] == 0 and u["reserved"]["day"] == 0
    assert spans.named("sluice.admission.reserve")[0]["sluice.granted"] is False
    assert spans.events_named("sluice.settle") == []  # nothing held, nothing to settle


async def test_a_client_leaving_mid_grant_leaves_nothing_behind() -> None:
    store = SlowStore()
    adm, who = Admission(config(), store), tenant()

    async def request() -> None:
        async with adm.reserve(who, "r4", 100):
            raise AssertionError("the client left before the grant")

    task = asyncio.ensure_future(request())
    await store.called.wait()
    task.cancel()  # the client leaves while the store call is in flight
    with pytest.raises(asyncio.CancelledError):
        await task
    store.go.set()  # the store call lands after the caller left
    for _ in range(100):
        await asyncio.sleep(0)
        if (await store.usage(who.id))["concurrency"] == 0 and not adm._settling:
            break
    u = await usage(adm, who)
    assert not adm.live and u["concurrency"] == 0
    assert u["reserved"]["day"] == 0 and u["settled"]["day"] == 0  # settled at zero


class CountingStore(MemoryStore):
    """Counts the renewal calls (each one store round trip in Redis)."""

    def __init__(self) -> None:
        super().__init__()
        self.renew_calls: list[tuple[str, int]] = []

    async def renew_many(self, tenant: str, request_ids: Any, lease_ttl_s: float) -> Any:
        self.renew_calls.append((tenant, len(request_ids)))
        return await super().renew_many(tenant, request_ids, lease_ttl_s)


async def test_the_renewal_beat_makes_one_store_call_per_tenant(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gateway.admission.RENEW_BATCH", 4)
    store = CountingStore()
    adm = Admission(config(), store)
    a, b = tenant(), dataclasses.replace(tenant(), id="beta")
    tickets = [await adm.grant(a, f"a{i}", 10) for i in range(6)]
    tickets += [await adm.grant(b, f"b{i}", 10) for i in range(3)]
    await adm.renew_leases()
    # alpha's six leases in two calls of at most RENEW_BATCH, beta's three in one
    assert sorted(store.renew_calls) == sorted([(a.id, 4), (a.id, 2), ("beta", 3)])
    for t in tickets:
        assert await store.renew(t.tenant, t.request_id, 1.0)  # every lease still live
        adm.settle(t, 1)
    await settled(adm)
    store.renew_calls.clear()
    await adm.renew_leases()
    assert store.renew_calls == []  # nothing live: no call at all


async def test_a_failing_beat_does_not_end_the_renewals() -> None:
    """A beat that raises what nobody expected (a hook's bug, an odd answer) is logged;
    the next beat still runs, or every lease would expire with the loop."""
    adm = Admission(config(), MemoryStore())
    adm.lease_ttl_s = 0.03  # a beat every 10 ms
    calls: list[int] = []

    async def broken() -> None:
        calls.append(1)
        raise RuntimeError("a bug in a hook")

    adm.renew_hooks.append(broken)
    adm.start()
    try:
        deadline = asyncio.get_running_loop().time() + 10
        while len(calls) < 3:
            assert asyncio.get_running_loop().time() < deadline, "the beat stopped"
            await asyncio.sleep(0.01)
        assert adm.beats >= 2
    finally:
        await adm.aclose()
