"""The UTC calendar of the day/month budgets: Lua (Hinnant's algorithm) and Python vs datetime."""

from __future__ import annotations

import calendar
import random
from collections.abc import AsyncIterator
from datetime import UTC, date, datetime, timedelta

import pytest
from redis.asyncio import Redis

from policies.periods import US, Periods, periods
from policies.redis_store import lua_source
from tests.policies.conftest import RedisServer

# Runs lib.lua's periods() over every ARGV (epoch µs) and checks that days_from_civil
# inverts civil_from_days.
PROBE = lua_source("lib") + """
local out = {}
for i = 1, #ARGV do
  local now = tonumber(ARGV[i])
  local p = periods(now)
  local z = math.floor(now / DAY_US)
  local roundtrip = days_from_civil(civil_from_days(z)) == z and 1 or 0
  out[i] = {p.day, p.month, p.day_end, p.month_end, p.keep_day, p.keep_month, roundtrip}
end
return out
"""


def expected(now_us: int) -> Periods:
    """Straight from datetime, independent of policies.periods."""
    dt = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=now_us)
    d = dt.date()
    first = d.replace(day=1)
    nxt = (first + timedelta(days=32)).replace(day=1)
    prev = (first - timedelta(days=1)).replace(day=1)
    two = d - timedelta(days=2)

    def us(x: date) -> int:
        return calendar.timegm(x.timetuple()) * US

    return Periods(day=int(d.strftime("%Y%m%d")), month=int(d.strftime("%Y%m")),
                   day_end_us=us(d + timedelta(days=1)), month_end_us=us(nxt),
                   keep_day=int(two.strftime("%Y%m%d")), keep_month=int(prev.strftime("%Y%m")))


def samples() -> list[int]:
    """Epoch µs: calendar edges (leap days, 2000, 2100, year ends) and random instants."""
    edges = [datetime(y, m, d, tzinfo=UTC) for y, m, d in (
        (1970, 1, 1), (1972, 2, 29), (1999, 12, 31), (2000, 2, 28), (2000, 2, 29),
        (2000, 3, 1), (2024, 2, 29), (2025, 1, 31), (2025, 12, 31), (2100, 2, 28),
        (2100, 3, 1), (2104, 2, 29), (2199, 12, 31), (2255, 1, 1))]
    out = []
    for e in edges:
        base = int(e.timestamp()) * US
        out += [base, base + 1, base + 86_400 * US - 1, base - 1 if base else 0]
    rng = random.Random(20250314)
    # Below 2**53 µs (year 2255): Lua numbers are doubles.
    out += [rng.randrange(0, 9_000_000_000 * US) for _ in range(3000)]
    return out


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def test_lua_calendar_matches_datetime(raw: Redis) -> None:
    probe = raw.register_script(PROBE)
    values = samples()
    rows = []
    for i in range(0, len(values), 500):  # a few hundred per call: Lua's stack is small
        rows += await probe(keys=[], args=values[i:i + 500])
    for now_us, row in zip(values, rows, strict=True):
        *fields, roundtrip = row
        assert Periods(*fields) == expected(now_us), now_us
        assert roundtrip == 1, now_us


def test_python_calendar_matches_datetime() -> None:
    for now_us in samples():
        assert periods(now_us) == expected(now_us), now_us
