"""One generation request as the backend saw it, and its trace, built when it has ended.

``RequestRecord`` collects what the HTTP side knows (tenant, W3C parent, validated request,
status, error, whether the client left); the engine's final ``OutputDelta`` brings its
monotonic timestamps. ``emit_spans`` then creates the spans retroactively, on the event loop
thread, with explicit start and end times, so the engine's step loop pays nothing but the
timestamp appends it makes anyway:

    chat sluice-tiny (SERVER, child of the incoming traceparent; named
    │                 "{gen_ai.operation.name} {gen_ai.request.model}" as the GenAI
    │                 semantic conventions say)
    ├── engine.queue    arrival in the engine → first scheduled
    ├── engine.prefill  first scheduled → first token; an event per prefill chunk
    ├── engine.decode   first token → finish; preemption recompute chunks as events
    └── engine.abort    abort asked → abort took effect (aborted requests only)

Only the OpenTelemetry API is used here; ``telemetry`` builds the tracer behind it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, StatusCode

from backend.engine.outputs import OutputDelta
from protocol.errors import ApiError
from telemetry.genai import PROVIDER, operation_name

if TYPE_CHECKING:
    from .service import Prepared

QUEUE = "engine.queue"
PREFILL = "engine.prefill"
PREFILL_CHUNK = "engine.prefill.chunk"
DECODE = "engine.decode"
ABORT = "engine.abort"
NO_TENANT = "-"


class RequestRecord:
    """One generation request from the handler's start to its end (times: engine clock)."""

    __slots__ = ("delta", "ended", "error", "gone", "kind", "opened", "p", "parent",
                 "received", "request_id", "requested_model", "shutdown", "status", "tenant")

    def __init__(self, request_id: str, kind: str, tenant: str, received: float,
                 parent: Context | None) -> None:
        self.request_id = request_id
        self.kind = kind  # chat | completion
        self.tenant = tenant
        self.received = received
        self.parent = parent  # the incoming W3C context (None: no header, or tracing off)
        self.requested_model: str | None = None
        self.p: Prepared | None = None
        self.opened = False  # submitted to the engine: a final delta will follow
        self.delta: OutputDelta | None = None  # the engine's final output
        self.error: ApiError | None = None  # what the client was told went wrong
        self.status = 0  # HTTP status sent; 0 while nothing was
        self.gone = False  # the client disconnected before the answer was complete
        self.shutdown = False  # the server cut the request short (grace period over)
        self.ended: float | None = None  # the handler returned

    @property
    def outcome(self) -> str:
        """success | cancelled | error | invalid (the requests_total label)."""
        d = self.delta
        if (d is not None and d.finish_reason == "abort") or self.gone or self.shutdown:
            return "cancelled"
        if self.error is not None:
            return "invalid" if self.error.status < 500 else "error"
        return "error" if d is None else "success"


def _error_type(err: ApiError) -> str:
    return err.code or err.type


def span_name(rec: RequestRecord) -> str:
    """``{gen_ai.operation.name} {gen_ai.request.model}``; the operation alone when the
    request was refused before its model was accepted (a client's string does not name
    spans)."""
    op = operation_name(rec.kind)
    return f"{op} {rec.p.model}" if rec.p is not None else op


def request_attributes(rec: RequestRecord, versions: dict[str, Any]) -> dict[str, Any]:
    """The request span's attributes (GenAI names where they exist, ``sluice.*`` else)."""
    attrs: dict[str, Any] = {
        "sluice.request.id": rec.request_id, "sluice.tenant.id": rec.tenant,
        "gen_ai.operation.name": operation_name(rec.kind), "gen_ai.provider.name": PROVIDER,
        "http.response.status_code": rec.status, "sluice.outcome": rec.outcome, **versions,
    }
    if rec.requested_model is not None:
        attrs["gen_ai.request.model"] = rec.requested_model
    p = rec.p
    if p is not None:
        attrs.update({"sluice.priority": p.priority, "gen_ai.request.stream": p.stream,
                      "gen_ai.response.id": p.response_id,
                      "gen_ai.request.max_tokens": p.params.max_tokens})
        # response_format's schema and the tools, as stamped on x-sluice-resolved (full hex)
        for name, sha in p.structured.versions().items():
            attrs[f"sluice.{name}_sha256"] = sha
        if p.temperature is not None:
            attrs["gen_ai.request.temperature"] = p.temperature
        if p.top_p is not None:
            attrs["gen_ai.request.top_p"] = p.top_p
    d = rec.delta
    if d is not None:
        attrs.update({"gen_ai.usage.input_tokens": d.num_prompt_tokens,
                      "gen_ai.usage.output_tokens": d.num_output_tokens,
                      "gen_ai.usage.cache_read.input_tokens": d.num_cached_tokens})
        if d.finish_reason:
            attrs["gen_ai.response.finish_reasons"] = [d.finish_reason]
        m = d.metrics
        if m is not None:
            if m.first_token_time is not None:
                ttft = m.first_token_time - rec.received
                attrs["sluice.ttft_ms"] = round(ttft * 1000, 3)
                attrs["gen_ai.response.time_to_first_chunk"] = ttft
            if m.queue_time is not None:
                attrs["sluice.queue_ms"] = round(m.queue_time * 1000, 3)
    if rec.error is not None:
        attrs["error.type"] = _error_type(rec.error)
    return attrs


def emit_spans(tracer: trace.Tracer, rec: RequestRecord, versions: dict[str, Any],
               clock: Callable[[], float]) -> None:
    """Create and end the request's spans from its recorded times (``clock``'s)."""
    offset = time.time_ns() - int(clock() * 1e9)  # engine clock → epoch ns

    def ns(t: float) -> int:
        return int(t * 1e9) + offset

    d = rec.delta
    m = d.metrics if d is not None else None
    end = rec.ended if rec.ended is not None else clock()
    if m is not None and m.finished_time is not None:
        end = max(end, m.finished_time)
    root = tracer.start_span(span_name(rec), rec.parent, SpanKind.SERVER,
                             request_attributes(rec, versions), start_time=ns(rec.received))
    if rec.error is not None and rec.error.status >= 500:
        root.set_status(StatusCode.ERROR, rec.error.message[:200])
    if d is not None and m is not None and root.is_recording():
        ctx = trace.set_span_in_context(root)
        fin = m.finished_time if m.finished_time is not None else end
        sched, first = m.first_scheduled_time, m.first_token_time
        tracer.start_span(QUEUE, ctx, start_time=ns(m.arrival_time)).end(
            ns(sched if sched is not None else fin))
        recompute: list[tuple[int, int, float, float]] = []
        if sched is not None:
            prefill = tracer.start_span(PREFILL, ctx, start_time=ns(sched), attributes={
                "sluice.prefix_cache.hit_tokens": d.num_cached_tokens})
            chunks = tokens = 0
            for chunk in m.prefill_chunks:
                if first is not None and chunk[3] > first:
                    recompute.append(chunk)  # after a preemption: the decode phase's
                    continue
                _chunk_event(prefill, chunk, ns)
                chunks += 1
                tokens += chunk[1]
            prefill.set_attributes({"sluice.prefill.chunks": chunks,
                                    "sluice.prefill.tokens": tokens})
            prefill.end(ns(first if first is not None else fin))
        if first is not None:
            decode = tracer.start_span(DECODE, ctx, start_time=ns(first), attributes={
                "gen_ai.usage.output_tokens": d.num_output_tokens,
                "sluice.preemptions": m.num_preemptions,
                "sluice.prefix_cache.hit_tokens": d.num_cached_tokens})
            for chunk in recompute:
                _chunk_event(decode, chunk, ns, recompute=True)
            decode.end(ns(fin))
        if d.finish_reason == "abort":
            asked = min(m.abort_time, fin) if m.abort_time is not None else fin
            attrs: dict[str, Any] = {
                "sluice.abort.reason": "client_disconnect" if rec.gone else "shutdown",
                "gen_ai.usage.output_tokens": d.num_output_tokens}
            if m.tokens_after_abort is not None:
                attrs["sluice.tokens_after_abort"] = m.tokens_after_abort
            tracer.start_span(ABORT, ctx, start_time=ns(asked), attributes=attrs).end(ns(fin))
    root.end(ns(end))


def _chunk_event(span: trace.Span, chunk: tuple[int, int, float, float],
                 ns: Callable[[float], int], recompute: bool = False) -> None:
    start, tokens, t0, t1 = chunk
    attrs: dict[str, Any] = {"sluice.chunk.start": start, "sluice.chunk.tokens": tokens,
                             "sluice.chunk.step_ms": round((t1 - t0) * 1000, 3)}
    if recompute:
        attrs["sluice.chunk.recompute"] = True
    span.add_event(PREFILL_CHUNK, attrs, timestamp=ns(t0))
