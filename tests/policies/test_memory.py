"""What only MemoryStore's fake clock can show: microsecond-exact waits, 23:59 UTC, days later.

The same behaviour on Redis is covered, with real-time bounds, by test_contract.py.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from policies.quotas import Quotas
from tests.policies.conftest import Harness
from tests.policies.test_contract import T, deny, grant


async def test_retry_after_is_exact_on_the_fake_clock(memory: Harness) -> None:
    h, q = memory, Quotas(tokens_per_minute=6000, requests_per_minute=60)
    await grant(h, "r1", 5990, q)
    d = await deny(h, "r2", 20, q, "tokens_per_minute")
    assert d.retry_after_s == pytest.approx(0.1)
    await h.advance(0.1 - 2e-6)
    await deny(h, "r3", 20, q, "tokens_per_minute")
    await h.advance(2e-6)
    await grant(h, "r4", 20, q)

async def test_daily_budget_waits_until_utc_midnight(memory: Harness) -> None:
    h, q = memory, Quotas(tokens_per_day=1000)
    assert h.clock is not None
    h.clock.now = float(datetime(2025, 3, 14, 23, 59, tzinfo=UTC).timestamp())
    await grant(h, "r1", 1000, q, ttl=120)
    d = await deny(h, "r2", 1, q, "tokens_per_day")
    assert d.retry_after_s == 60.0
    await h.advance(60)
    await grant(h, "r3", 1000, q)  # a new day, a new budget
    # Yesterday's reservation settles into yesterday: today's counters only see r3.
    assert await h.store.settle(T, "r1", 10)
    u = await h.store.usage(T)
    assert (u["reserved"]["day"], u["settled"]["day"], u["requests"]["day"]) == (1000, 0, 1)
    assert (u["reserved"]["month"], u["settled"]["month"]) == (2000 - 1000, 10)

async def test_settling_after_the_days_counters_were_pruned(memory: Harness) -> None:
    h, q = memory, Quotas(tokens_per_day=1000)
    await grant(h, "old", 700, q, ttl=5 * 86400)  # a lease renewed for days (a long stream)
    await h.advance(4 * 86400)
    await grant(h, "new", 100, q)  # a new day: counters older than 3 days are pruned
    assert await h.store.settle(T, "old", 650)
    u = await h.store.usage(T)
    assert (u["reserved"]["day"], u["settled"]["day"], u["requests"]["day"]) == (100, 0, 1)
    # March 14 + 4 days: the month's counters are still kept and take the settlement.
    assert (u["reserved"]["month"], u["settled"]["month"]) == (100, 650)
