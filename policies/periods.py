"""UTC calendar periods of the day and month budgets, from epoch microseconds.

`lua/lib.lua` computes the same thing inside Redis (Redis 7 Lua has no `os.date`); the
test suite checks both against `datetime`.
"""

from __future__ import annotations

import calendar
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

US = 1_000_000
DAY_US = 86_400 * US


@dataclass(slots=True, frozen=True)
class Periods:
    day: int          # YYYYMMDD of now
    month: int        # YYYYMM of now
    day_end_us: int   # next UTC midnight
    month_end_us: int  # first instant of next month
    keep_day: int     # oldest day still kept: counters of older days are pruned (3 days)
    keep_month: int   # oldest month still kept (this one and the previous one)


def periods(now_us: int) -> Periods:
    today = datetime.fromtimestamp(now_us // US, UTC).date()
    first_next = date(today.year + today.month // 12, today.month % 12 + 1, 1)
    last_prev = today.replace(day=1) - timedelta(days=1)
    two_ago = today - timedelta(days=2)
    return Periods(
        day=_ymd(today),
        month=today.year * 100 + today.month,
        day_end_us=(now_us // DAY_US + 1) * DAY_US,
        month_end_us=calendar.timegm(first_next.timetuple()) * US,
        keep_day=_ymd(two_ago),
        keep_month=last_prev.year * 100 + last_prev.month,
    )


def _ymd(d: date) -> int:
    return d.year * 10_000 + d.month * 100 + d.day
