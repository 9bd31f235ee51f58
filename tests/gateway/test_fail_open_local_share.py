"""Fail-open admission with the quota store down: the local share (limit ÷ replicas) on a
``MemoryStore``, driven through ``Admission`` on a fake clock. The refund at settle is
what keeps it a share of the tenant's limit rather than of its worst cases (the reason it
is not aiolimiter: tests/policies/test_local_share.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from gateway.admission import Admission
from gateway.errors import GatewayError
from policies.memory import MemoryStore
from policies.store import StoreUnavailable
from tests.gateway.stage_kit import config
from tests.gateway.stage_kit import quota_tenant as tenant

START = 1_767_232_800.0  # 2026-01-01 02:00 UTC


class DownStore(MemoryStore):
    """A quota store that cannot be reached."""

    async def reserve(self, *args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("connection refused")

    async def settle(self, *args: Any, **kwargs: Any) -> bool:
        raise StoreUnavailable("connection refused")


async def settled(adm: Admission) -> None:
    while adm._settling:
        await asyncio.wait(adm._settling)


async def test_fail_open_share_refunds_at_settle_and_names_the_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # each refused store call is undone twice, the second time a second later: not here
    monkeypatch.setattr("gateway.admission.UNDO_AGAIN_S", 0.0)
    cfg = config()
    cfg = cfg.model_copy(update={"store": cfg.store.model_copy(update={"replicas": 3})})
    adm = Admission(cfg, DownStore())
    now = [START]
    adm.local = MemoryStore(clock=lambda: now[0])
    who = dataclasses.replace(tenant(tokens_per_minute=30_000), fail_mode="open")
    admitted = 0
    with pytest.raises(GatewayError) as refused:
        for i in range(100):  # all at one instant: only the refunds make room
            # worst case 2,000 (prompt + max_tokens), 200 used: the share (10,000) takes
            # 41 of them (10,000 - 40 × 200 = 2,000 left for the 41st), not 5
            ticket = await adm.grant(who, f"r{i}", 2_000)
            assert ticket.local and ticket.store is adm.local
            adm.settle(ticket, 200)
            await settled(adm)
            admitted += 1
    assert admitted == 41 and adm.fail_open == {"one": 41} and not adm.store_up
    err = refused.value
    assert err.status == 429 and err.param == "tokens_per_minute"
    assert err.retry_after_s == pytest.approx(1.2)  # 1,800 left: 200 short at 10,000/min
    now[0] += 1.2
    assert (await adm.grant(who, "late", 2_000)).local
    await settled(adm)
