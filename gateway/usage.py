"""Settlement: what each request actually cost, recorded per tenant.

A request settles exactly once, however it ends (finished, cancelled by the client, failed
upstream): prompt tokens plus the completion tokens actually generated. Exact counts come
from the upstream's usage (the gateway always asks for it); when the stream was cut before
the usage arrived, the last running count the upstream reported (``continuous_usage_stats``)
or, failing that, the number of content chunks relayed stands in.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from .outcome import Ended

log = logging.getLogger("sluice.gateway.usage")

_REMEMBERED_IDS = 65536


@dataclass(slots=True, frozen=True)
class Settlement:
    request_id: str  # this attempt's own id (the client's x-request-id may repeat)
    tenant: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    outcome: str  # an ``outcome.Outcome`` value
    exact: bool  # counts reported by the upstream, not estimated


@dataclass(slots=True, frozen=True)
class LedgerSnapshot:
    """What the metrics read of the ledger."""

    settled: tuple[tuple[str, str, str, int], ...]  # (tenant, model, outcome, count), sorted
    tokens: tuple[tuple[str, int, int], ...]  # (tenant, prompt, completion tokens), sorted


@dataclass(slots=True)
class TenantUsage:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


class UsageLedger:
    def __init__(self) -> None:
        self._settled: OrderedDict[str, None] = OrderedDict()
        self.by_tenant: dict[str, TenantUsage] = {}
        self.by_key: dict[tuple[str, str, str], int] = {}  # (tenant, model, outcome) -> count

    def snapshot(self) -> LedgerSnapshot:
        return LedgerSnapshot(
            settled=tuple((t, m, o, n) for (t, m, o), n in sorted(self.by_key.items())),
            tokens=tuple((t, u.prompt_tokens, u.completion_tokens)
                         for t, u in sorted(self.by_tenant.items())))

    def settle_ended(self, request_id: str, ended: Ended) -> bool:
        """Settle a request that held a reservation (``request_id``: its attempt's id)."""
        p = ended.prepared
        if not ended.reserved or p is None:
            return False
        prompt, completion, exact = ended.tokens()
        return self.settle(Settlement(request_id, p.tenant.id, p.upstream.name, prompt,
                                      completion, ended.outcome.value, exact))

    def settle(self, s: Settlement) -> bool:
        """Record ``s``; a second settlement of the same request id is ignored."""
        if s.request_id in self._settled:
            return False
        self._settled[s.request_id] = None
        if len(self._settled) > _REMEMBERED_IDS:
            self._settled.popitem(last=False)
        usage = self.by_tenant.setdefault(s.tenant, TenantUsage())
        usage.requests += 1
        usage.prompt_tokens += s.prompt_tokens
        usage.completion_tokens += s.completion_tokens
        key = (s.tenant, s.model, s.outcome)
        self.by_key[key] = self.by_key.get(key, 0) + 1
        log.info("settled request_id=%s tenant=%s model=%s prompt_tokens=%d "
                 "completion_tokens=%d outcome=%s exact=%s", s.request_id, s.tenant, s.model,
                 s.prompt_tokens, s.completion_tokens, s.outcome, s.exact)
        return True
