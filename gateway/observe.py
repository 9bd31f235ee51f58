"""A generation request's metrics and trace attributes, recorded once it has ended,
however it ended, from its ``Ended`` record (or, refused before an exchange began, from
what the client was told)."""

from __future__ import annotations

import time

from telemetry import priority_class
from telemetry.genai import operation_name

from .client_io import Reply
from .errors import GatewayError
from .metrics import GatewayMetrics
from .outcome import Ended, Outcome, classify
from .timing import RequestTimes
from .tracing import reject_reason

_REJECTED = (Outcome.REJECTED_429, Outcome.REJECTED_503, Outcome.DEADLINE)


def outcome_of(reply: Reply, ended: Ended | None) -> Outcome:
    """The exchange's outcome, or, refused before one began (draining, auth, body), what
    the client was told."""
    return ended.outcome if ended is not None else classify(reply.status, reply.error)


def error_type(outcome: Outcome, error: GatewayError | None) -> str:
    """``error.type`` of a request: empty for a success, else the error code the client was
    told, else the outcome (``cancelled``, ``upstream_error``)."""
    if outcome is Outcome.SUCCESS:
        return ""
    if error is not None:
        return error.code or type(error).__name__
    return outcome.value


def observe(metrics: GatewayMetrics, reply: Reply, ended: Ended | None, times: RequestTimes,
            outcome: Outcome, kind: str) -> None:
    """Record the request's metrics and its usage on the trace; ``kind``: chat | completion."""
    e2e = time.monotonic() - times.received
    p = ended.prepared if ended is not None else None
    model = p.upstream.name if p is not None else "-"
    operation = operation_name(kind)
    metrics.requests.inc(reply.tenant, model, outcome.value)
    # the GenAI model label is empty (the attribute absent) before the model is resolved
    metrics.genai.ended(operation, model if p is not None else "", e2e,
                        error_type(outcome, reply.error))
    if outcome in _REJECTED and reply.error is not None:
        metrics.rejected.inc(reply.tenant, reject_reason(reply.error))
    if ended is None or p is None:
        return
    relay = ended.relay
    prompt, completion, _ = ended.tokens()
    trace = reply.trace
    if trace.recording and ended.reserved:
        reason = relay.finish_reason if relay is not None else None
        trace.set(input_tokens=prompt, output_tokens=completion,
                  cached_tokens=relay.cached_tokens if relay is not None else None,
                  finish_reason=(reason,) if reason is not None else None)
    labels = (reply.tenant, model, priority_class(p.priority))
    if ended.queued_s is not None:
        metrics.queue_time.observe(ended.queued_s, *labels)
    if relay is not None and relay.accepted:
        metrics.input_tokens.inc(reply.tenant, model, by=prompt)
        metrics.output_tokens.inc(reply.tenant, model, by=completion)
        metrics.genai_client.used(operation, model, prompt, completion)
    ttft = times.first - times.received if times.first is not None else None
    if ttft is not None:
        metrics.ttft.observe(ttft, *labels)
    if outcome is not Outcome.SUCCESS:
        return
    metrics.e2e.observe(e2e, *labels)
    tpot = None
    if times.first is not None and times.last is not None and completion >= 2:
        # TPOT per the capacity lesson: (t_last - t_first) / (N_out - 1)
        tpot = (times.last - times.first) / (completion - 1)
        metrics.tpot.observe(tpot, *labels)
    metrics.genai.answered(operation, model, ttft, tpot)
