"""Token-bucket arithmetic in integers: levels in micro-units, times in microseconds.

A bucket of capacity `cap` (per minute) refills cap/60 units per second, i.e. cap/60
micro-units per microsecond. Its level may be negative: a settle whose actual cost beat
the reservation charges the extra, and the debt is refilled like any other deficit.
`lua/lib.lua` mirrors these functions; Lua numbers are doubles, exact for integers below
2**53, which holds for capacities up to 10**8 per minute.
"""

from __future__ import annotations

US = 1_000_000


def refill(level: int, since_us: int, now_us: int, cap: int) -> int:
    """The level at `now_us` of a bucket that held `level` at `since_us`, capped at cap."""
    full = cap * US
    need = full - level
    elapsed = now_us - since_us
    if need <= 0 or elapsed <= 0:
        return min(level, full)
    if elapsed * cap >= need * 60:
        return full
    return level + elapsed * cap // 60


def wait_us(level: int, cap: int, cost: int) -> int | None:
    """Microseconds until `cost` units are available: 0 now, None never (cost > cap)."""
    deficit = cost * US - level
    if deficit <= 0:
        return 0
    if cost > cap or cap == 0:  # cap == 0 with a debt never refills
        return None
    return -(-deficit * 60 // cap)


def reset_us(level: int, cap: int) -> int:
    """Microseconds until the bucket is full again."""
    need = cap * US - level
    return -(-need * 60 // cap) if need > 0 and cap > 0 else 0


def remaining(level: int) -> int:
    """Whole units available now (what `x-ratelimit-remaining-*` shows)."""
    return max(0, level // US)
