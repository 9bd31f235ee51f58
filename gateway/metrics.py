"""The gateway's metrics: per-request latencies and outcomes recorded as requests end,
plus gauges and counters read from live state at scrape time. ``docs/metrics.md`` defines
every one of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from telemetry.metrics import (
    CONTENT_TYPE,
    LATENCY_BUCKETS,
    TOKEN_BUCKETS,
    Family,
    HistogramPoint,
    Registry,
)

from .upstream import Upstream
from .usage import UsageLedger

__all__ = ["CONTENT_TYPE", "GatewayMetrics", "RequestTimes"]

P = "sluice_gateway_"
SLO_LABELS = ("tenant", "model", "priority_class")


class RequestTimes:
    """Monotonic timestamps of one request as the gateway saw it."""

    __slots__ = ("first", "itl", "last", "received")

    def __init__(self, received: float) -> None:
        self.received = received
        self.first: float | None = None  # first content chunk relayed
        self.last: float | None = None  # last content chunk relayed
        self.itl: HistogramPoint | None = None  # this request's ITL histogram point

    def chunks(self, n: int, now: float) -> bool:
        """``n`` more content chunks relayed at ``now``; True for the request's first."""
        if n <= 0:
            return False
        first = self.first is None
        itl = self.itl
        if first:
            self.first = now
        elif itl is not None and self.last is not None:
            itl.observe(now - self.last)
        if itl is not None:
            for _ in range(n - 1):  # chunks read together arrived together
                itl.observe(0.0)
        self.last = now
        return first


class GatewayMetrics:
    def __init__(self, registry: Registry | None = None) -> None:
        r = self.registry = registry or Registry()
        self.inflight = 0
        self.responses = r.counter(P + "responses_total",
                                   "Responses sent, by route, tenant and status.",
                                   ("route", "tenant", "status"))
        self.requests = r.counter(P + "requests_total",
                                  "Generation requests by final outcome.",
                                  ("tenant", "model", "outcome"))
        self.rejected = r.counter(P + "rejected_total",
                                  "Requests the gateway refused, by reason (the quota hit or "
                                  "the error code).", ("tenant", "reason"))
        self.input_tokens = r.counter(P + "input_tokens_total",
                                      "Prompt tokens of settled requests.", ("tenant", "model"))
        self.output_tokens = r.counter(P + "output_tokens_total",
                                       "Completion tokens of settled requests.",
                                       ("tenant", "model"))
        self.ttft = r.histogram(P + "ttft_seconds", "Time to first token: request received "
                                "to first content chunk relayed.", SLO_LABELS, LATENCY_BUCKETS)
        self.tpot = r.histogram(P + "tpot_seconds", "Time per output token: (t_last - t_first)"
                                " / (output tokens - 1); none for one-token answers.",
                                SLO_LABELS, TOKEN_BUCKETS)
        self.itl = r.histogram(P + "itl_seconds", "Inter-token latency: gap between "
                               "consecutive content chunks relayed.", SLO_LABELS, TOKEN_BUCKETS)
        self.e2e = r.histogram(P + "e2e_seconds", "End to end: request received to response "
                               "ended, successful requests.", SLO_LABELS, LATENCY_BUCKETS)
        self.queue_time = r.histogram(P + "queue_time_seconds", "Time waiting for upstream "
                                      "capacity in the gateway's queue.", SLO_LABELS,
                                      LATENCY_BUCKETS)
        self._state: tuple[UsageLedger, dict[str, Upstream], dict[str, Any], Any] | None = None
        r.collector(self._live)

    def bind(self, ledger: UsageLedger, upstreams: dict[str, Upstream],
             queues: dict[str, Any], admission: Any) -> None:
        """Where the scrape-time values live (the Gateway's parts)."""
        self._state = (ledger, upstreams, queues, admission)

    def observe_response(self, route: str, tenant: str, status: int) -> None:
        self.responses.inc(route, tenant, str(status))

    def render(self) -> str:
        return self.registry.render()

    def _live(self) -> Iterator[Family]:
        yield Family(P + "inflight_requests", "gauge",
                     "Generation requests in flight.").add(self.inflight)
        if self._state is None:
            return
        ledger, upstreams, queues, admission = self._state
        yield _family(P + "requests_settled_total", "counter", "Settled generation requests.",
                      ((v, {"tenant": t, "model": m, "outcome": o})
                       for (t, m, o), v in sorted(ledger.by_key.items())))
        tokens = Family(P + "tokens_total", "counter", "Settled tokens per tenant.")
        for tenant, usage in sorted(ledger.by_tenant.items()):
            tokens.add(usage.prompt_tokens, tenant=tenant, type="prompt")
            tokens.add(usage.completion_tokens, tenant=tenant, type="completion")
        yield tokens
        yield _family(P + "upstream_ready", "gauge", "Whether the upstream's versions are known.",
                      ((1 if up.ready else 0, {"model": n}) for n, up in upstreams.items()))
        qs = sorted(queues.items())
        yield _family(P + "queue_length", "gauge", "Requests waiting for upstream capacity.",
                      ((q.size, {"model": n}) for n, q in qs))
        yield _family(P + "slots_held", "gauge",
                      "Upstream slots (in-flight requests) this replica holds.",
                      ((len(q.held), {"model": n}) for n, q in qs))
        yield _family(P + "upstream_inflight_tokens", "gauge", "Worst-case tokens (prompt + "
                      "max output) of the requests in flight to the upstream.",
                      ((q.held_tokens, {"model": n}) for n, q in qs))
        yield _family(P + "dispatched_total", "counter", "Requests dispatched from the queue.",
                      ((c, {"model": n, "tenant": t}) for n, q in qs
                       for t, c in sorted(q.dispatched.items())))
        yield _family(P + "rejects_total", "counter", "Requests refused by a tenant limit.",
                      ((v, {"tenant": t, "limit": lim})
                       for (t, lim), v in sorted(admission.rejects.items())))
        yield _family(P + "fail_open_total", "counter", "Requests admitted by the local share "
                      "while the quota store was unreachable.",
                      ((v, {"tenant": t}) for t, v in sorted(admission.fail_open.items())))
        yield Family(P + "store_errors_total", "counter",
                     "Quota store calls that failed.").add(admission.store_errors)
        yield Family(P + "store_up", "gauge", "1 when the last quota-store call worked.").add(
            1 if admission.store_up else 0)
        yield Family(P + "leases_live", "gauge",
                     "Quota leases held by this replica.").add(len(admission.live))


def _family(name: str, kind: str, help_text: str,
            samples: Iterable[tuple[float, dict[str, str]]]) -> Family:
    fam = Family(name, kind, help_text)  # type: ignore[arg-type]
    for value, labels in samples:
        fam.add(value, **labels)
    return fam
