"""A replica's share of a tenant's limits while the quota store is unreachable (fail-open).

The gateway admits a ``fail_mode: open`` tenant against a local ``MemoryStore`` holding
``local_share(quotas, replicas)``: the same five limits, the same atomic all-or-nothing
decision, the same Retry-After and ``x-ratelimit-*`` arithmetic as the shared store, so a
tenant sees one behaviour whether Redis is up or down.

Not aiolimiter's ``AsyncLimiter`` (issue #26 asked for it unless a side-by-side test showed
a reason; tests/policies/test_local_share.py runs both on one fake clock):
* tokens per minute: the reservation is the worst case and settle refunds the unused part;
  ``AsyncLimiter`` has no release, so the same traffic is admitted 9 times, not 60;
* requests per minute: the admitted counts match, but its level, which Retry-After and
  ``x-ratelimit-remaining-requests`` need, is private (``_level``), and a limiter beside
  the store splits the one decision: a denial names the rpm wait (seconds) while the day
  budget holds the tenant until midnight;
* day and month budgets and concurrency leases have no counterpart in it.
docs/admission.md#fail-open-local-share-and-aiolimiter has the figures and the command.
"""

from __future__ import annotations

from dataclasses import replace

from policies.quotas import Quotas


def local_share(q: Quotas, replicas: int) -> Quotas:
    """This replica's conservative share of a tenant's limits while the store is down:
    each limit ÷ ``replicas``, rounded down (``replicas`` >= 1)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, not {replicas!r}")

    def part(v: int | None) -> int | None:
        return None if v is None else v // replicas

    return replace(q, tokens_per_minute=part(q.tokens_per_minute),
                   requests_per_minute=part(q.requests_per_minute),
                   tokens_per_day=part(q.tokens_per_day),
                   tokens_per_month=part(q.tokens_per_month),
                   max_concurrency=part(q.max_concurrency))
