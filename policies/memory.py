"""MemoryStore: the quota store of one process (the embedded default), all in dicts.

Atomicity: no method awaits between reading and writing state, so on one event loop every
call is one atomic step, as a Lua script is in Redis. Not thread-safe. The clock is
injected (epoch seconds; tests pass a fake one); the calendar periods are UTC days and
months of that clock. Semantics are those of `policies.store` and of `lua/*.lua`, which
this module mirrors function for function (refill, sweep, close, prune), the sweep's bound
(SWEEP_LIMIT) included, so that both stores leave the same backlog after the same calls.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from policies import buckets, hold
from policies.periods import DAY_US, US, Periods, periods
from policies.quotas import (
    MAX_CONCURRENCY,
    REQUESTS_PER_MINUTE,
    TOKENS_PER_DAY,
    TOKENS_PER_MINUTE,
    TOKENS_PER_MONTH,
    Decision,
    Quotas,
    RateHeaders,
)
from policies.store import DuplicateRequest, Usage, check_tenant, check_tokens, ttl_us

#: Expired reservations released, and closed ids forgotten, per call at most (lua/lib.lua's
#: SWEEP_LIMIT): a backlog drains over successive calls.
SWEEP_LIMIT = 64


@dataclass(slots=True)
class _Bucket:
    level: int  # micro-units at `at_us`; negative while in debt
    at_us: int
    cap: int    # capacity it was last written with (settle refunds up to it)


@dataclass(slots=True)
class _Reservation:
    tokens: int
    day: int               # the periods it was charged to, YYYYMMDD / YYYYMM
    month: int
    tpm_cap: int | None    # TPM capacity it was charged against; None: not charged
    expires_us: int        # lease and reservation die together
    started_us: int        # when it was reserved (its slot-hold time runs from here)


@dataclass(slots=True)
class _Period:
    reserved: int = 0
    used: int = 0
    requests: int = 0
    rejects: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Tenant:
    buckets: dict[str, _Bucket] = field(default_factory=dict)   # "tpm", "rpm"
    days: dict[int, _Period] = field(default_factory=dict)
    months: dict[int, _Period] = field(default_factory=dict)
    # Insertion order is reservation order, so the first is the oldest (the clock only
    # moves forward; Redis keeps the same order in its `starts` ZSET).
    open: dict[str, _Reservation] = field(default_factory=dict)
    # Heap over `open` by expiry; stale entries (renewed, closed) are skipped as they surface.
    expiry: list[tuple[int, str]] = field(default_factory=list)
    closed: dict[str, int] = field(default_factory=dict)        # request id -> forget at
    forget: list[tuple[int, str]] = field(default_factory=list)  # heap over `closed`
    day: int = 0                                                # last day reserve() saw
    hold_est: hold.HoldEstimate | None = None  # how long its requests hold a slot


class MemoryStore:
    """The in-process Store; see `policies.store` for the contract."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._tenants: dict[str, _Tenant] = {}

    async def reserve(self, tenant: str, request_id: str, tokens: int, quotas: Quotas,
                      lease_ttl_s: float) -> Decision:
        check_tenant(tenant)
        check_tokens(tokens)
        ttl = ttl_us(lease_ttl_s)
        now = self._now()
        t = self._tenants.setdefault(tenant, _Tenant())
        _sweep(t, now)
        p = periods(now)
        if t.day != p.day:
            _prune(t, p)
        if request_id in t.open or t.closed.get(request_id, 0) > now:  # due: forgotten
            raise DuplicateRequest(f"request {request_id!r} of {tenant!r} was reserved before")
        tcap, rcap = quotas.tokens_per_minute, quotas.requests_per_minute
        tpm = None if tcap is None else _level(t, "tpm", tcap, now)
        rpm = None if rcap is None else _level(t, "rpm", rcap, now)
        day = t.days.setdefault(p.day, _Period())
        month = t.months.setdefault(p.month, _Period())

        denials: list[tuple[str, int | None]] = []  # (limit, wait µs or None = never)
        if tpm is not None and tcap is not None:
            denials.append((TOKENS_PER_MINUTE, buckets.wait_us(tpm, tcap, tokens)))
        if rpm is not None and rcap is not None:
            denials.append((REQUESTS_PER_MINUTE, buckets.wait_us(rpm, rcap, 1)))
        for name, limit, period, end_us in (
            (TOKENS_PER_DAY, quotas.tokens_per_day, day, p.day_end_us),
            (TOKENS_PER_MONTH, quotas.tokens_per_month, month, p.month_end_us),
        ):
            if limit is not None and period.reserved + period.used + tokens > limit:
                denials.append((name, None if tokens > limit else end_us - now))
        cmax = quotas.max_concurrency
        if cmax is not None and _live_leases(t, now) >= cmax:
            denials.append((MAX_CONCURRENCY, _slot_wait(t, now) if cmax > 0 else None))
        denials = [(name, wait) for name, wait in denials if wait != 0]

        if denials:
            name, wait = max(denials, key=lambda d: math.inf if d[1] is None else d[1])
            day.rejects[name] = day.rejects.get(name, 0) + 1
            return Decision(False, name, None if wait is None else wait / US,
                            _rate(quotas, tpm, rpm))
        if tpm is not None and tcap is not None:
            tpm -= tokens * US
            t.buckets["tpm"] = _Bucket(tpm, now, tcap)
        if rpm is not None and rcap is not None:
            rpm -= US
            t.buckets["rpm"] = _Bucket(rpm, now, rcap)
        day.reserved += tokens
        day.requests += 1
        month.reserved += tokens
        t.open[request_id] = _Reservation(tokens, p.day, p.month, tcap, now + ttl, now)
        heapq.heappush(t.expiry, (now + ttl, request_id))
        return Decision(True, None, None, _rate(quotas, tpm, rpm))

    async def renew(self, tenant: str, request_id: str, lease_ttl_s: float) -> bool:
        ttl = ttl_us(lease_ttl_s)
        t, now = self._find(tenant)
        r = _live(t, request_id, now) if t else None
        if t is None or r is None:
            return False
        r.expires_us = now + ttl
        heapq.heappush(t.expiry, (r.expires_us, request_id))
        return True

    async def renew_many(self, tenant: str, request_ids: Sequence[str],
                         lease_ttl_s: float) -> list[bool]:
        return [await self.renew(tenant, rid, lease_ttl_s) for rid in request_ids]

    async def settle(self, tenant: str, request_id: str, actual_tokens: int) -> bool:
        check_tokens(actual_tokens)
        t, now = self._find(tenant)
        r = _live(t, request_id, now) if t else None
        if t is None or r is None:
            return False
        if r.tpm_cap is not None:
            b = t.buckets.get("tpm")
            cap = b.cap if b else r.tpm_cap
            level = buckets.refill(b.level, b.at_us, now, cap) if b else cap * US
            level = min(level + (r.tokens - actual_tokens) * US, cap * US)
            t.buckets["tpm"] = _Bucket(level, now, cap)
        if actual_tokens > 0:  # a request that never ran says nothing of how long they run
            t.hold_est = hold.observe(t.hold_est, now - r.started_us)
        _close(t, request_id, actual_tokens, r.expires_us + DAY_US)  # live: expiry > now
        return True

    async def usage(self, tenant: str) -> Usage:
        t, now = self._find(tenant)
        t = t or _Tenant()
        p = periods(now)
        day = t.days.get(p.day, _Period())
        month = t.months.get(p.month, _Period())
        reserved = {"day": day.reserved, "month": month.reserved}
        b = t.buckets.get("tpm")
        if b is not None:
            drawn = b.cap * US - buckets.refill(b.level, b.at_us, now, b.cap)
            reserved["minute"] = -(-drawn // US)
        return {"reserved": reserved,
                "settled": {"day": day.used, "month": month.used},
                "requests": {"day": day.requests},
                "concurrency": _live_leases(t, now),
                "rejects": dict(day.rejects)}

    async def concurrency(self, tenant: str) -> int:
        t, now = self._find(tenant)
        return _live_leases(t, now) if t else 0

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def _now(self) -> int:
        return math.floor(self._clock() * US)

    def _find(self, tenant: str) -> tuple[_Tenant | None, int]:
        """A known tenant with its expired work released (reads never create tenants)."""
        check_tenant(tenant)
        now = self._now()
        t = self._tenants.get(tenant)
        if t is not None:
            _sweep(t, now)
        return t, now


def _level(t: _Tenant, name: str, cap: int, now: int) -> int:
    """Level of a bucket refilled to now (a bucket never written is full)."""
    b = t.buckets.get(name)
    return cap * US if b is None else buckets.refill(b.level, b.at_us, now, cap)


def _rate(q: Quotas, tpm: int | None, rpm: int | None) -> RateHeaders:
    rcap, tcap = q.requests_per_minute, q.tokens_per_minute
    return RateHeaders(
        limit_requests=rcap,
        remaining_requests=None if rpm is None else buckets.remaining(rpm),
        reset_requests_s=None if rpm is None or rcap is None else buckets.reset_us(rpm, rcap) / US,
        limit_tokens=tcap,
        remaining_tokens=None if tpm is None else buckets.remaining(tpm),
        reset_tokens_s=None if tpm is None or tcap is None else buckets.reset_us(tpm, tcap) / US,
    )


def _close(t: _Tenant, request_id: str, actual: int | None, forget_at: int) -> None:
    """Move a reservation from reserved to used (its worst case when actual is None)."""
    r = t.open.pop(request_id)
    used = r.tokens if actual is None else actual
    for period in (t.days.get(r.day), t.months.get(r.month)):
        if period is not None:  # None: pruned, a period long over
            period.reserved -= r.tokens
            period.used += used
    t.closed[request_id] = forget_at
    heapq.heappush(t.forget, (forget_at, request_id))


def _current(t: _Tenant, entry: tuple[int, str]) -> bool:
    """Whether a heap entry is its open reservation's expiry (else renewed or closed)."""
    r = t.open.get(entry[1])
    return r is not None and r.expires_us == entry[0]


def _next_expiry(t: _Tenant) -> int | None:
    """The earliest expiry of an open reservation, expired or not; None if none is open."""
    while t.expiry and not _current(t, t.expiry[0]):
        heapq.heappop(t.expiry)
    return t.expiry[0][0] if t.expiry else None


def _backlog(t: _Tenant, now: int) -> bool:
    """Whether expired reservations are still open (the sweep stopped at its limit)."""
    first = _next_expiry(t)
    return first is not None and first <= now


def _live(t: _Tenant, request_id: str, now: int) -> _Reservation | None:
    """The reservation if its lease is live; one expired but not swept yet is released here,
    as the sweep would have (lib.lua's live_expiry)."""
    r = t.open.get(request_id)
    if r is None or r.expires_us > now:
        return r
    _close(t, request_id, None, now + DAY_US)
    return None


def _live_leases(t: _Tenant, now: int) -> int:
    """Unexpired leases: every open one, unless the sweep left a backlog to skip."""
    if not _backlog(t, now):
        return len(t.open)
    return sum(r.expires_us > now for r in t.open.values())


def _slot_wait(t: _Tenant, now: int) -> int:
    """The predicted wait for one of the tenant's slots (policies/hold.py), at most the
    earliest live lease expiry (there is a live lease: the caller counted them)."""
    first = _next_expiry(t)
    if first is None or first <= now:  # a backlog: the earliest expiry still to come
        first = min(r.expires_us for r in t.open.values() if r.expires_us > now)
    # The oldest live lease among the SWEEP_LIMIT oldest (`open` is in reservation order);
    # age 0 (unknown) if those all expired, as lib.lua's oldest_live_age.
    oldest = next((r for r in itertools.islice(t.open.values(), SWEEP_LIMIT)
                   if r.expires_us > now), None)
    age = 0 if oldest is None else now - oldest.started_us
    return hold.wait_us(t.hold_est, age, first - now)


def _sweep(t: _Tenant, now: int) -> None:
    """Release expired reservations (earliest expiry first) and forget closed ids past
    their time (earliest first), at most SWEEP_LIMIT of each: lib.lua's sweep. Stale heap
    entries (renewed, closed, closed again) are dropped on the way without counting: they
    have no counterpart in Redis's ZSETs."""
    released = 0
    while released < SWEEP_LIMIT and t.expiry and t.expiry[0][0] <= now:
        entry = heapq.heappop(t.expiry)
        if _current(t, entry):
            _close(t, entry[1], None, now + DAY_US)
            released += 1
    forgotten = 0
    while forgotten < SWEEP_LIMIT and t.forget and t.forget[0][0] <= now:
        forget_at, rid = heapq.heappop(t.forget)
        if t.closed.get(rid) == forget_at:
            del t.closed[rid]
            forgotten += 1


def _prune(t: _Tenant, p: Periods) -> None:
    """On a new day, drop counters of days and months no reservation can still touch."""
    t.days = {d: v for d, v in t.days.items() if d >= p.keep_day}
    t.months = {m: v for m, v in t.months.items() if m >= p.keep_month}
    t.day = p.day
