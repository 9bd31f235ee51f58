"""One trace per generation request: the ``sluice.request`` span and its phases.

The relay calls ``RequestTrace`` at each phase boundary; with tracing off it is
``NO_TRACE``, whose methods do nothing, so the hot path pays one attribute lookup and a
call per phase. Attribute names follow the OpenTelemetry GenAI semantic conventions where
they exist (``gen_ai.*``), and ``sluice.*`` elsewhere. Only the OpenTelemetry API is used
here; ``telemetry`` builds the tracer behind it.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

from protocol.versions import ResolvedVersions
from telemetry import extract, new_span_id, record_phase

from .errors import GatewayError
from .resolve import Prepared

_CLIENT, _INTERNAL = SpanKind.CLIENT, SpanKind.INTERNAL  # (enum lookups run Python code)

# phase span names (children of sluice.request)
AUTH = "sluice.auth"
RESERVE = "sluice.admission.reserve"
QUEUE = "sluice.queue.wait"
UPSTREAM = "sluice.upstream"
RELAY = "sluice.relay"
SETTLE = "sluice.settle"


class NoTrace:
    """Tracing off (or this request not sampled): every call is a no-op."""

    __slots__ = ()
    recording = False

    def start(self, name: str, attributes: dict[str, Any] | None = None) -> Any:
        return None

    def end(self, span: Any, **attributes: Any) -> None:
        pass

    def set(self, **attributes: Any) -> None:
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
    """A request the sampler left out: nothing is recorded, but the trace context still
    travels upstream (sampled flag off), so the next hop makes the same decision."""

    __slots__ = ("_traceparent",)

    def __init__(self, root: trace.Span) -> None:
        ctx = root.get_span_context()
        self._traceparent = (f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-"
                             f"{int(ctx.trace_flags):02x}").encode()

    def upstream_headers(self, span: Any) -> list[tuple[bytes, bytes]]:
        return [(b"traceparent", self._traceparent)]


def request_trace(tracer: trace.Tracer, route: str, request_id: str,
                  traceparent_header: bytes | None, tracestate: bytes | None) -> NoTrace:
    """The request's trace: recording, or only propagating when not sampled."""
    rt = RequestTrace(tracer, route, request_id, traceparent_header, tracestate)
    return rt if rt.root.is_recording() else Unsampled(rt.root)


Phase = tuple[str, int, "dict[str, Any] | None", int]  # name, start ns, attributes, span id


class RequestTrace(NoTrace):
    """The root span, and its phases recorded as batched children (``record_phase``): a
    request's seven spans cost a few tuple stores each on the hot path."""

    __slots__ = ("attrs", "root", "tracer")
    recording = True

    def __init__(self, tracer: trace.Tracer, route: str, request_id: str,
                 traceparent_header: bytes | None, tracestate: bytes | None) -> None:
        parent = extract(traceparent_header.decode("latin-1") if traceparent_header else None,
                         tracestate.decode("latin-1") if tracestate else None)
        self.tracer = tracer
        self.root = tracer.start_span("sluice.request", parent, SpanKind.SERVER)
        # set on the root once, at the end
        self.attrs: dict[str, Any] = {
            "http.request.method": "POST", "http.route": route, "sluice.request.id": request_id,
            "gen_ai.operation.name": "chat" if route.endswith("chat/completions")
            else "text_completion"}

    def start(self, name: str, attributes: dict[str, Any] | None = None) -> Phase:
        return (name, time.time_ns(), attributes, new_span_id() if name == UPSTREAM else 0)

    def end(self, span: Phase | None, **attributes: Any) -> None:
        if span is None:
            return
        name, start_ns, attrs, span_id = span
        if attributes:
            attrs = {**attrs, **attributes} if attrs else attributes
        record_phase(self.tracer, self.root, name, start_ns, time.time_ns(), attrs,
                     _CLIENT if span_id else _INTERNAL, span_id)

    def set(self, **attributes: Any) -> None:
        attrs = self.attrs
        for k, v in attributes.items():
            if v is not None:
                attrs[_NAMES.get(k, k)] = v

    def stamp(self, stamp: ResolvedVersions) -> None:
        self.attrs.update(_stamp_attributes(stamp))

    def first_token(self, ttft_s: float) -> None:
        ms = round(ttft_s * 1000, 3)
        self.attrs["sluice.ttft_ms"] = ms
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
        if span is None:
            return []
        ctx = self.root.get_span_context()
        value = f"00-{ctx.trace_id:032x}-{span[3]:016x}-{int(ctx.trace_flags):02x}"
        return [(b"traceparent", value.encode())]

    def finish(self, status: int, outcome: str) -> None:
        attrs = self.attrs
        attrs["http.response.status_code"] = status
        attrs["sluice.outcome"] = outcome
        root = self.root
        root.set_attributes(attrs)
        root.end()


# short keyword → attribute name, for RequestTrace.set(**kw)
_NAMES = {
    "tenant": "sluice.tenant.id",
    "priority": "sluice.priority",
    "model": "gen_ai.request.model",
    "max_tokens": "gen_ai.request.max_tokens",
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "stream": "sluice.stream",
    "input_tokens": "gen_ai.usage.input_tokens",
    "output_tokens": "gen_ai.usage.output_tokens",
    "cached_tokens": "gen_ai.usage.cached_tokens",
    "finish_reason": "gen_ai.response.finish_reasons",
    "ttft_ms": "sluice.ttft_ms",
    "queue_ms": "sluice.queue_ms",
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
    """A prepared request's attributes on its root span (GenAI names where they exist)."""
    trace.set(priority=p.priority, model=p.upstream.name + (f"@{p.pin}" if p.pin else ""),
              max_tokens=p.max_tokens, temperature=p.body.get("temperature"),
              top_p=p.body.get("top_p"), stream=p.stream, worst_case=p.worst_case)
    trace.stamp(p.stamp)
    if p.degraded:
        trace.set(**{"sluice.degraded": p.degraded})


def reject_reason(err: GatewayError) -> str:
    """Why the gateway refused: the quota that was hit, else the error code."""
    if err.status == 429 and err.param and err.code == "rate_limit_exceeded":
        return err.param  # tokens_per_minute, requests_per_minute, max_concurrency, …
    return err.code or type(err).__name__
