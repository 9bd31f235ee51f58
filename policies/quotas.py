"""Value objects of admission: a tenant's quotas and the store's decision.

`Quotas` is what a tenant's policy limits (None = unlimited); `Decision` is what one
atomic `Store.reserve` answered, with the OpenAI-style `x-ratelimit-*` values as they
stand *after* the reservation (reservations really lower `remaining`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Final

TOKENS_PER_MINUTE: Final = "tokens_per_minute"
REQUESTS_PER_MINUTE: Final = "requests_per_minute"
TOKENS_PER_DAY: Final = "tokens_per_day"
TOKENS_PER_MONTH: Final = "tokens_per_month"
MAX_CONCURRENCY: Final = "max_concurrency"

#: Every name `Decision.denied_by` can take, in the order limits are checked; when several
#: deny, the binding one (longest wait, "never" longest of all) is named, ties to the first.
LIMITS: Final = (TOKENS_PER_MINUTE, REQUESTS_PER_MINUTE, TOKENS_PER_DAY, TOKENS_PER_MONTH,
                 MAX_CONCURRENCY)


@dataclass(slots=True, frozen=True)
class Quotas:
    """A tenant's limits; None = unlimited.

    The per-minute limits are token buckets (capacity = the limit, refilled at limit/60 per
    second); the day and month budgets are calendar periods in UTC; `max_concurrency`
    counts live leases.
    """

    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{f.name} must be a non-negative int or None, not {value!r}")


def format_reset(seconds: float) -> str:
    """Duration the way OpenAI writes `x-ratelimit-reset-*`: "250ms", "1s", "1.5s", "6m0s".

    Rounded up to the millisecond, so that a client waiting that long is never early.
    """
    ms = max(0, math.ceil(seconds * 1000 - 1e-9))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    head = (f"{hours}h" if hours else "") + (f"{minutes}m" if hours or minutes else "")
    return f"{head}{secs}s"


@dataclass(slots=True, frozen=True)
class RateHeaders:
    """OpenAI-style `x-ratelimit-*` values of the per-minute buckets (None: no such limit).

    `remaining_*` is the bucket level rounded down (never below 0); `reset_*_s` is the time
    until the bucket is full again.
    """

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float | None = None

    def as_headers(self) -> list[tuple[bytes, bytes]]:
        """The headers of the limits that exist, ready for an ASGI response."""
        out: list[tuple[bytes, bytes]] = []
        for kind, limit, remaining, reset in (
            ("requests", self.limit_requests, self.remaining_requests, self.reset_requests_s),
            ("tokens", self.limit_tokens, self.remaining_tokens, self.reset_tokens_s),
        ):
            if limit is None:
                continue
            out.append((f"x-ratelimit-limit-{kind}".encode(), str(limit).encode()))
            out.append((f"x-ratelimit-remaining-{kind}".encode(), str(remaining or 0).encode()))
            out.append((f"x-ratelimit-reset-{kind}".encode(), format_reset(reset or 0.0).encode()))
        return out


@dataclass(slots=True, frozen=True)
class Decision:
    """The answer of one atomic reservation.

    granted: everything was taken. Otherwise nothing was, `denied_by` names the binding
    limit and `retry_after_s` is the time until the same reservation would succeed: exact
    for a bucket refill or a period end; for max_concurrency the predicted end of the oldest
    running request (policies/hold.py), at most the earliest lease expiry. None when it
    never can (the cost exceeds a bucket's capacity or a budget, or max_concurrency is 0).
    """

    granted: bool
    denied_by: str | None
    retry_after_s: float | None
    rate: RateHeaders
