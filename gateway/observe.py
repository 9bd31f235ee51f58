"""How a generation request ended, and its metrics: recorded once, however it ended."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from telemetry import priority_class

from .client_io import Reply
from .errors import InternalError
from .metrics import RequestTimes
from .tracing import reject_reason

if TYPE_CHECKING:
    from .relay import Exchange
    from .service import Gateway


_REJECTED_503 = frozenset({"overloaded", "store_unavailable", "deadline_unreachable"})


def classify(reply: Reply, exchange: Exchange | None) -> str:
    """success | cancelled | rejected_429 | rejected_503 | deadline | upstream_error |
    invalid (another 4xx) | error (the gateway's own 500)."""
    if exchange is not None:
        if exchange.outcome == "cancelled" or (exchange.client_gone and not exchange.done):
            return "cancelled"
        if exchange.done and exchange.outcome == "ok" and reply.error is None:
            return "success"
    err = reply.error
    status = err.status if err is not None else reply.status
    code = err.code if err is not None else None
    if status == 429:
        return "rejected_429"
    if status == 503 and code in _REJECTED_503:
        return "rejected_503"
    if code == "deadline_exceeded":
        return "deadline"
    if status == 500 and isinstance(err, InternalError):
        return "error"
    if exchange is not None and exchange.accepted or status >= 500:
        return "upstream_error"
    if status == 0:
        return "cancelled"  # the client left before anything was sent
    return "invalid"


def observe(gw: Gateway, reply: Reply, exchange: Exchange | None, times: RequestTimes,
             outcome: str) -> None:
    """The request's metrics, once it has ended however it ended."""
    m = gw.metrics
    p = exchange.p if exchange is not None else None
    model = p.upstream.name if p is not None else "-"
    m.requests.inc(reply.tenant, model, outcome)
    if outcome in ("rejected_429", "rejected_503", "deadline") and reply.error is not None:
        m.rejected.inc(reply.tenant, reject_reason(reply.error))
    if exchange is None or p is None:
        return
    labels = (reply.tenant, model, priority_class(p.priority))
    if exchange.queued_s is not None:
        m.queue_time.observe(exchange.queued_s, *labels)
    if exchange.accepted:
        m.input_tokens.inc(reply.tenant, model, by=exchange.prompt_tokens)
        m.output_tokens.inc(reply.tenant, model, by=exchange.completion_tokens)
    if times.first is not None:
        m.ttft.observe(times.first - times.received, *labels)
    if outcome != "success":
        return
    m.e2e.observe(time.monotonic() - times.received, *labels)
    n = exchange.completion_tokens
    if times.first is not None and times.last is not None and n >= 2:
        # TPOT per the capacity lesson: (t_last - t_first) / (N_out - 1)
        m.tpot.observe((times.last - times.first) / (n - 1), *labels)
