"""One trace per generation request: its server span and its phases.

The relay calls ``RequestTrace`` at each phase boundary; with tracing off it is
``NO_TRACE``, whose methods do nothing, so the hot path pays one attribute lookup and a
call per phase. The request span is named as the OpenTelemetry GenAI semantic conventions
say, ``{gen_ai.operation.name} {gen_ai.request.model}`` (``chat sluice-tiny``), and carries
their attributes (``gen_ai.*``); Sluice's own are ``sluice.*``.

Phases that wait on something are child spans: the admission store call, the queue wait
(only when the request did wait), each upstream attempt (a live CLIENT span: its id is the
``traceparent`` the upstream gets) and a retry's backoff. Instant steps (auth, the start of
the answer to the client, settling) are events on the request span: a span costs the
stock SDK ~30 µs to create and ~30 µs to encode, an event a few. A phase span is created
when it ends, with its start time (``start`` returns only a name, a timestamp and the
attributes), so an unended phase costs nothing.

The request span is the current span while the request is served, so instrumentation
libraries (redis, httpx) put their spans into the same trace. Only the OpenTelemetry API is
used here; ``telemetry`` builds the SDK's tracer behind it.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

from protocol.versions import ResolvedVersions
from telemetry import extract
from telemetry.genai import PROVIDER, operation_name

from .errors import GatewayError
from .resolve import Prepared

_CLIENT, _INTERNAL = SpanKind.CLIENT, SpanKind.INTERNAL  # (enum lookups run Python code)

# phase span names (children of the request span)
RESERVE = "sluice.admission.reserve"
QUEUE = "sluice.queue.wait"
UPSTREAM = "sluice.upstream"
BACKOFF = "sluice.retry.backoff"
# event names (on the request span)
AUTH = "sluice.auth"
RELAY = "sluice.relay"  # the answer's status line and headers go to the client
SETTLE = "sluice.settle"


class NoTrace:
    """Tracing off: every call is a no-op."""

    __slots__ = ()
    recording = False

    def start(self, name: str, attributes: dict[str, Any] | None = None) -> Any:
        return None

    def end(self, span: Any, **attributes: Any) -> None:
        pass

    def event(self, name: str, **attributes: Any) -> None:
        pass

    def set(self, **attributes: Any) -> None:
        pass

    def model(self, name: str) -> None:
        pass

    def stamp(self, stamp: ResolvedVersions) -> None:
        pass

    def first_token(self, ttft_s: float) -> None:
        pass

    def error(self, err: GatewayError) -> None:
        pass

    def upstream_headers(self, span: Any) -> list[tuple[bytes, bytes]]:
        return []

    def finish(self, status: int, outcome: str) -> None:
        pass


NO_TRACE = NoTrace()


class Unsampled(NoTrace):
    """A request the sampler left out: nothing is recorded, but the trace context is the
    current one while the request is served and travels upstream (sampled flag off), so
    the next hop and any instrumentation make the same decision."""

    __slots__ = ("_headers", "_token")

    def __init__(self, root: trace.Span) -> None:
        self._headers = w3c_headers(root.get_span_context())
        self._token = otel_context.attach(trace.set_span_in_context(root))

    def upstream_headers(self, span: Any) -> list[tuple[bytes, bytes]]:
        return self._headers

    def finish(self, status: int, outcome: str) -> None:
        otel_context.detach(self._token)


def w3c_headers(ctx: trace.SpanContext) -> list[tuple[bytes, bytes]]:
    """W3C ``traceparent`` naming ``ctx`` as the next hop's parent, and the caller's
    ``tracestate`` passed on when there is one (vendors' entries travel with the trace)."""
    parent = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
    headers = [(b"traceparent", parent.encode())]
    if ctx.trace_state:
        headers.append((b"tracestate", ctx.trace_state.to_header().encode("latin-1")))
    return headers


# a phase: a live span (the upstream attempt) or (name, start ns, attributes) until it ends
Phase = trace.Span | tuple[str, int, dict[str, Any] | None]


def request_trace(tracer: trace.Tracer, kind: str, route: str, request_id: str,
                  traceparent_header: bytes | None, tracestate: bytes | None) -> NoTrace:
    """The request's trace (``kind``: chat | completion): recording, or only propagating
    when not sampled. The parent is the client's W3C ``traceparent``, else the current
    span (an ASGI instrumentation's)."""
    parent = extract(traceparent_header.decode("latin-1") if traceparent_header else None,
                     tracestate.decode("latin-1") if tracestate else None)
    op = operation_name(kind)
    root = tracer.start_span(op, parent, SpanKind.SERVER)
    if not root.is_recording():
        return Unsampled(root)
    return RequestTrace(tracer, root, op, route, request_id)


class RequestTrace(NoTrace):
    """The request span; its phase spans, created when they end (the upstream attempt is
    a live span); instant steps as events on it. Attributes of the request span are
    collected in a dict and set once, at the end."""

    __slots__ = ("attrs", "ctx", "op", "root", "token", "tracer")
    recording = True

    def __init__(self, tracer: trace.Tracer, root: trace.Span, op: str, route: str,
                 request_id: str) -> None:
        self.tracer = tracer
        self.root = root
        self.op = op
        self.ctx = trace.set_span_in_context(root)
        self.token = otel_context.attach(self.ctx)
        self.attrs: dict[str, Any] = {
            "http.request.method": "POST", "http.route": route, "sluice.request.id": request_id,
            "gen_ai.operation.name": op, "gen_ai.provider.name": PROVIDER}

    def start(self, name: str, attributes: dict[str, Any] | None = None) -> Phase:
        if name == UPSTREAM:  # live: its span id goes upstream as the traceparent
            return self.tracer.start_span(name, self.ctx, _CLIENT, attributes)
        return (name, time.time_ns(), attributes)

    def end(self, span: Phase | None, **attributes: Any) -> None:
        if span is None:
            return
        if isinstance(span, tuple):
            name, start_ns, attrs = span
            if attributes:
                attrs = {**attrs, **attributes} if attrs else attributes
            self.tracer.start_span(name, self.ctx, _INTERNAL, attrs, start_time=start_ns).end()
            return
        if attributes:
            span.set_attributes(attributes)
        span.end()

    def event(self, name: str, **attributes: Any) -> None:
        self.root.add_event(name, attributes or None)

    def set(self, **attributes: Any) -> None:
        attrs = self.attrs
        for k, v in attributes.items():
            if v is not None:
                attrs[_NAMES.get(k, k)] = v

    def model(self, name: str) -> None:
        """The span's name once the model is known: ``chat sluice-tiny``."""
        self.root.update_name(f"{self.op} {name}")

    def stamp(self, stamp: ResolvedVersions) -> None:
        self.attrs.update(_stamp_attributes(stamp))

    def first_token(self, ttft_s: float) -> None:
        ms = round(ttft_s * 1000, 3)
        self.attrs["sluice.ttft_ms"] = ms
        self.attrs["gen_ai.response.time_to_first_chunk"] = ttft_s
        self.root.add_event("gen_ai.first_token", {"sluice.ttft_ms": ms})

    def error(self, err: GatewayError) -> None:
        attrs = self.attrs
        attrs["error.type"] = err.code or type(err).__name__
        if err.status in (429, 503) or err.code in ("deadline_exceeded",
                                                    "deadline_unreachable"):
            attrs["sluice.reject.reason"] = reject_reason(err)
        if err.retry_after_s is not None:
            attrs["sluice.retry_after_s"] = round(err.retry_after_s, 3)
        if err.status >= 500:
            self.root.set_status(StatusCode.ERROR, err.message[:200])

    def upstream_headers(self, span: Phase | None) -> list[tuple[bytes, bytes]]:
        """W3C traceparent naming the upstream phase as the next hop's parent."""
        if span is None or isinstance(span, tuple):
            return []
        return w3c_headers(span.get_span_context())

    def finish(self, status: int, outcome: str) -> None:
        attrs = self.attrs
        attrs["http.response.status_code"] = status
        attrs["sluice.outcome"] = outcome
        root = self.root
        root.set_attributes(attrs)
        root.end()
        otel_context.detach(self.token)


# short keyword → attribute name, for RequestTrace.set(**kw)
_NAMES = {
    "tenant": "sluice.tenant.id",
    "priority": "sluice.priority",
    "model": "gen_ai.request.model",
    "max_tokens": "gen_ai.request.max_tokens",
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "stream": "gen_ai.request.stream",
    "seed": "gen_ai.request.seed",
    "choices": "gen_ai.request.choice.count",
    "top_k": "gen_ai.request.top_k",
    "frequency_penalty": "gen_ai.request.frequency_penalty",
    "presence_penalty": "gen_ai.request.presence_penalty",
    "stop": "gen_ai.request.stop_sequences",
    "input_tokens": "gen_ai.usage.input_tokens",
    "output_tokens": "gen_ai.usage.output_tokens",
    "cached_tokens": "gen_ai.usage.cache_read.input_tokens",
    "finish_reason": "gen_ai.response.finish_reasons",
    "ttft_ms": "sluice.ttft_ms",
    "queue_ms": "sluice.queue_ms",
    "chunks": "sluice.chunks",
    "worst_case": "sluice.reserved_tokens",
}


_STAMPS: dict[tuple[str, int, str | None], tuple[Any, dict[str, Any]]] = {}


def _stamp_attributes(stamp: ResolvedVersions) -> dict[str, Any]:
    """The versions that produced an answer (the same for every request of a version).
    Cached by model, policy and the identity of the versions object (one per upstream
    refresh): hashing the dataclasses would run Python code over their fields."""
    v = stamp.versions
    key = (stamp.model, id(v), stamp.policy)
    hit = _STAMPS.get(key)
    if hit is not None and hit[0] is v:
        return hit[1]
    attrs = {
        "gen_ai.response.model": stamp.model,
        "sluice.model.revision": v.revision,
        "sluice.tokenizer": v.tokenizer,
        "sluice.chat_template": v.chat_template,
        "sluice.engine": v.engine,
        "sluice.policy": stamp.policy,
        "sluice.system_fingerprint": stamp.fingerprint(),
    }
    if len(_STAMPS) >= 1024:
        _STAMPS.clear()
    _STAMPS[key] = (v, attrs)  # the versions object is kept, so its id is not reused
    return attrs


def describe(trace: NoTrace, p: Prepared) -> None:
    """A prepared request's attributes on its span (GenAI names where they exist), and the
    span's name with the model in it."""
    trace.model(p.upstream.name)
    body = p.body
    stop = body.get("stop")
    seed = body.get("seed")
    if not isinstance(seed, int) or not -(1 << 63) <= seed < 1 << 63:
        seed = None  # an OTLP int attribute is 64 bits
    trace.set(priority=p.priority, model=p.upstream.name + (f"@{p.pin}" if p.pin else ""),
              max_tokens=p.max_tokens, temperature=body.get("temperature"),
              top_p=body.get("top_p"), stream=p.stream, worst_case=p.worst_case,
              seed=seed, choices=body.get("n"), top_k=body.get("top_k"),
              frequency_penalty=body.get("frequency_penalty"),
              presence_penalty=body.get("presence_penalty"),
              stop=[stop] if isinstance(stop, str) else stop)
    trace.stamp(p.stamp)
    for name, sha256 in p.request_versions.items():  # the request's schema and tools, full hex
        trace.set(**{f"sluice.{name}_sha256": sha256})
    if p.degraded:
        trace.set(**{"sluice.degraded": p.degraded})


def reject_reason(err: GatewayError) -> str:
    """Why the gateway refused: the quota that was hit, else the error code."""
    if err.status == 429 and err.param and err.code == "rate_limit_exceeded":
        return err.param  # tokens_per_minute, requests_per_minute, max_concurrency, …
    return err.code or type(err).__name__
