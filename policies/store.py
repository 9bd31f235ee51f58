"""The quota store: one interface, two implementations (MemoryStore, RedisStore).

    StoreError              a request the store refuses (a reused request id, a bad argument)
    ├── DuplicateRequest    reserve() of a request id that is reserved, settled or released
    └── StoreUnavailable    the store cannot be reached or did not answer in time;
                            callers apply their fail mode (open or closed)

Invariants both implementations keep (one shared test suite checks them):

- One atomic step per decision. reserve() takes everything (TPM bucket, RPM bucket, day
  and month reserved counters, one concurrency lease, the reservation record) or, when any
  limit denies, nothing at all, counting the reject by reason.
- A reservation and its lease are one record, alive until now >= expiry (lease TTL,
  extended by renew()). Every call first *releases* up to SWEEP_LIMIT (64) of a tenant's
  expired reservations, oldest first (a dead replica's backlog drains over later calls); an
  expired lease never counts as live meanwhile. A dead replica cannot report usage, so
  their reserved tokens become used at their worst case.
- settle() is idempotent by request id: the first call refunds (reserved - actual) to the
  TPM bucket (capped at capacity; a negative refund charges the extra), moves the day and
  month counters of the reservation's own periods from reserved to used, and releases the
  lease; later calls, and calls after expiry, return False and change nothing.
- A max_concurrency denial waits for the oldest live lease's predicted end, learned from
  how long the tenant's settled requests held theirs (policies/hold.py): at least 100 ms,
  at most the earliest lease expiry (unless that is sooner than 100 ms); settle() records
  the time held unless nothing was used.
- Times are those of the store's clock (the injected clock, or Redis TIME), in integer
  microseconds; bucket levels are integer micro-tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from policies.quotas import Decision, Quotas

# Leases (or capacity slots) renewed per store (or gate) call at most: one renewal beat of
# a thousand streams is a few round trips, each holding Redis well under a millisecond.
RENEW_BATCH = 256


class StoreError(Exception):
    """Base of the store's errors."""


class DuplicateRequest(StoreError):
    """The request id was reserved before: reserving it again would double-charge."""


class StoreUnavailable(StoreError):
    """The store cannot be reached or timed out."""


#: usage() answers this shape: {"reserved": {"minute"?, "day", "month"}, "settled": {"day",
#: "month"}, "requests": {"day"}, "concurrency": n, "rejects": {reason: n}} (today, UTC).
Usage = dict[str, Any]


@runtime_checkable
class Store(Protocol):
    async def reserve(self, tenant: str, request_id: str, tokens: int, quotas: Quotas,
                      lease_ttl_s: float) -> Decision:
        """Atomically take `tokens` from every budget plus one lease, or nothing."""
        ...

    async def renew(self, tenant: str, request_id: str, lease_ttl_s: float) -> bool:
        """Set the lease's expiry to now + ttl; False if unknown, settled or expired."""
        ...

    async def renew_many(self, tenant: str, request_ids: Sequence[str],
                         lease_ttl_s: float) -> list[bool]:
        """``renew`` of each id, in one atomic step (one round trip): the renewal beat's
        call, one per tenant."""
        ...

    async def settle(self, tenant: str, request_id: str, actual_tokens: int) -> bool:
        """Close the reservation with its actual cost; False (a no-op) if already closed."""
        ...

    async def usage(self, tenant: str) -> Usage:
        """Today's and this month's counters (UTC), live leases, today's rejects by reason."""
        ...

    async def concurrency(self, tenant: str) -> int:
        """Live (unexpired) leases."""
        ...

    async def ping(self) -> None:
        """Raise StoreUnavailable unless the store answers."""
        ...

    async def close(self) -> None: ...


def check_tenant(tenant: str) -> None:
    # Braces would change the Redis Cluster hash tag `{tenant}` that pins a tenant's keys
    # to one slot; both stores refuse them so that they accept the same tenants.
    if not tenant or "{" in tenant or "}" in tenant:
        raise ValueError(f"tenant must be non-empty and free of braces, not {tenant!r}")


def check_tokens(tokens: int) -> None:
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"token counts must be non-negative ints, not {tokens!r}")


def ttl_us(lease_ttl_s: float) -> int:
    """The lease TTL in whole microseconds (rounded up); must be positive."""
    if not lease_ttl_s > 0 or math.isinf(lease_ttl_s):
        raise ValueError(f"lease_ttl_s must be positive and finite, not {lease_ttl_s!r}")
    return math.ceil(lease_ttl_s * 1_000_000)
