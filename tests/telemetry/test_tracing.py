"""The gateway's request trace on the stock SDK (``gateway/tracing.py``), and W3C
propagation (``telemetry.extract`` / ``traceparent``)."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from opentelemetry.trace import SpanKind, StatusCode

from gateway.errors import ServiceUnavailable
from gateway.tracing import (
    AUTH,
    NO_TRACE,
    QUEUE,
    RELAY,
    RESERVE,
    SETTLE,
    UPSTREAM,
    RequestTrace,
    Unsampled,
    describe,
    request_trace,
)
from protocol.errors import AuthenticationFailed
from telemetry import extract, traceparent

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def make(sampler: Any = None) -> tuple[trace.Tracer, InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler) if sampler is not None else TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return provider.get_tracer("sluice.gateway"), memory


def by_name(memory: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {s.name: s for s in memory.get_finished_spans()}


def prepared(**body: Any) -> Any:
    """What ``describe`` reads of a prepared request."""
    stamp = SimpleNamespace(model="m", policy="p1", versions=SimpleNamespace(
        revision="r", tokenizer="t", chat_template="c", engine="e"),
        fingerprint=lambda: "fp_1")
    return SimpleNamespace(upstream=SimpleNamespace(name="m"), pin=None, priority=2,
                           max_tokens=16, body=body, stream=True, worst_case=40, stamp=stamp,
                           degraded=None, request_versions={"schema": "ab" * 32})


def test_a_request_is_a_server_span_named_by_the_genai_conventions() -> None:
    tracer, memory = make()
    rt = request_trace(tracer, "chat", "/v1/chat/completions", "rid-1", PARENT.encode(), b"v=1")
    assert isinstance(rt, RequestTrace) and rt.recording
    describe(rt, prepared(temperature=0.5, top_p=0.9, seed=7, n=2, stop="\n",
                          frequency_penalty=0.1, presence_penalty=0.2))
    rt.set(tenant="acme", input_tokens=5, output_tokens=3, cached_tokens=2,
           finish_reason=("stop",))
    rt.first_token(0.012)
    rt.finish(200, "success")
    root = by_name(memory)["chat m"]
    assert root.kind is SpanKind.SERVER
    assert root.parent is not None and root.parent.span_id == 0x00f067aa0ba902b7
    assert root.context.trace_id == 0x4bf92f3577b34da6a3ce929d0e0e4736
    assert root.context.trace_state.to_header() == "v=1"
    a = dict(root.attributes or {})
    assert {k: a[k] for k in (
        "gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model",
        "gen_ai.request.max_tokens", "gen_ai.request.temperature", "gen_ai.request.top_p",
        "gen_ai.request.seed", "gen_ai.request.choice.count", "gen_ai.request.stream",
        "gen_ai.request.frequency_penalty", "gen_ai.request.presence_penalty",
        "gen_ai.response.model", "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens",
        "gen_ai.usage.cache_read.input_tokens", "http.response.status_code",
        "sluice.tenant.id", "sluice.outcome", "sluice.engine")} == {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "sluice",
        "gen_ai.request.model": "m", "gen_ai.request.max_tokens": 16,
        "gen_ai.request.temperature": 0.5, "gen_ai.request.top_p": 0.9,
        "gen_ai.request.seed": 7, "gen_ai.request.choice.count": 2,
        "gen_ai.request.stream": True, "gen_ai.request.frequency_penalty": 0.1,
        "gen_ai.request.presence_penalty": 0.2, "gen_ai.response.model": "m",
        "gen_ai.usage.input_tokens": 5, "gen_ai.usage.output_tokens": 3,
        "gen_ai.usage.cache_read.input_tokens": 2, "http.response.status_code": 200,
        "sluice.tenant.id": "acme", "sluice.outcome": "success", "sluice.engine": "e"}
    assert a["gen_ai.request.stop_sequences"] == ("\n",)
    assert a["gen_ai.response.finish_reasons"] == ("stop",)
    assert a["gen_ai.response.time_to_first_chunk"] == 0.012
    assert a["sluice.schema_sha256"] == "ab" * 32 and "sluice.tools_sha256" not in a
    assert [e.name for e in root.events] == ["gen_ai.first_token"]


def test_a_seed_that_does_not_fit_64_bits_is_left_out() -> None:
    tracer, memory = make()
    rt = request_trace(tracer, "completion", "/v1/completions", "rid", None, None)
    describe(rt, prepared(seed=1 << 70))
    rt.finish(200, "success")
    root = by_name(memory)["text_completion m"]
    assert "gen_ai.request.seed" not in (root.attributes or {})
    assert root.parent is None


def test_before_the_model_is_known_the_span_is_named_by_the_operation() -> None:
    tracer, memory = make()
    rt = request_trace(tracer, "chat", "/v1/chat/completions", "rid", None, None)
    rt.event(AUTH, **{"error.type": "invalid_api_key"})
    rt.error(AuthenticationFailed("bad key"))
    rt.finish(401, "unauthorized")
    [root] = memory.get_finished_spans()  # auth is an event on the request span, no span
    assert root.name == "chat"
    assert root.attributes is not None and root.attributes["error.type"] == "invalid_api_key"
    assert root.status.status_code is StatusCode.UNSET  # a 4xx is the client's error
    [auth] = root.events
    assert auth.name == AUTH and dict(auth.attributes or {}) == {
        "error.type": "invalid_api_key"}
    assert root.start_time is not None and root.end_time is not None
    assert root.start_time <= auth.timestamp <= root.end_time


def test_instant_steps_are_events_on_the_request_span_in_order() -> None:
    """Auth, the answer's start (relay) and settling are events, not spans: the request
    span carries them in the order they happened, inside its own time."""
    tracer, memory = make()
    rt = request_trace(tracer, "chat", "/v1/chat/completions", "rid", None, None)
    rt.event(AUTH, **{"sluice.tenant.id": "acme"})
    rt.event(RELAY)
    rt.first_token(0.005)
    rt.set(chunks=4)  # a streamed answer's chunk count is the request span's
    rt.event(SETTLE, **{"gen_ai.usage.input_tokens": 7, "gen_ai.usage.output_tokens": 4})
    rt.finish(200, "success")
    [root] = memory.get_finished_spans()
    assert [(e.name, dict(e.attributes or {})) for e in root.events] == [
        (AUTH, {"sluice.tenant.id": "acme"}),
        (RELAY, {}),
        ("gen_ai.first_token", {"sluice.ttft_ms": 5.0}),
        (SETTLE, {"gen_ai.usage.input_tokens": 7, "gen_ai.usage.output_tokens": 4})]
    times = [e.timestamp for e in root.events]
    assert root.start_time is not None and root.end_time is not None
    assert root.start_time <= times[0] and times == sorted(times) and times[-1] <= root.end_time
    assert root.attributes is not None and root.attributes["sluice.chunks"] == 4


def test_phases_are_child_spans_and_the_upstream_one_is_the_next_hops_parent() -> None:
    tracer, memory = make()
    rt = request_trace(tracer, "chat", "/v1/chat/completions", "rid", None, None)
    reserve = rt.start(RESERVE, {"sluice.reserved_tokens": 40})
    # a waiting phase is only a name, a start time and attributes until it ends: no span yet
    assert isinstance(reserve, tuple) and reserve[0] == RESERVE
    assert memory.get_finished_spans() == ()
    rt.end(reserve, **{"sluice.granted": True})
    up = rt.start(UPSTREAM, {"sluice.attempt": 1})
    # the upstream attempt is a live span: its id is the traceparent the upstream gets
    assert isinstance(up, trace.Span) and up.is_recording()
    [(name, value)] = rt.upstream_headers(up)
    rt.event(RELAY)
    rt.end(up, **{"http.response.status_code": 200})
    rt.error(ServiceUnavailable("overloaded", code="queue_full", retry_after_s=1.5))
    rt.finish(503, "shed")
    spans = by_name(memory)
    assert set(spans) == {"chat", RESERVE, UPSTREAM}  # the relay is an event, not a span
    root, upstream, reserved = spans["chat"], spans[UPSTREAM], spans[RESERVE]
    assert upstream.kind is SpanKind.CLIENT and reserved.kind is SpanKind.INTERNAL
    assert dict(upstream.attributes or {}) == {"sluice.attempt": 1,
                                              "http.response.status_code": 200}
    assert dict(reserved.attributes or {}) == {"sluice.reserved_tokens": 40,
                                              "sluice.granted": True}
    # created when it ended, with the start time taken when it started
    assert reserved.start_time == reserve[1]
    assert reserved.start_time is not None and reserved.end_time is not None
    assert reserved.start_time <= reserved.end_time
    assert name == b"traceparent" and value.decode() == traceparent(_span(upstream))
    for phase in (upstream, reserved):
        assert phase.parent is not None and phase.parent.span_id == root.context.span_id
        assert phase.context.trace_id == root.context.trace_id
    assert [e.name for e in root.events] == [RELAY]
    assert root.status.status_code is StatusCode.ERROR
    assert root.attributes is not None
    assert root.attributes["sluice.reject.reason"] == "queue_full"
    assert root.attributes["sluice.retry_after_s"] == 1.5


def test_a_phase_that_never_ends_costs_no_span() -> None:
    """The queue stage ends its span only when the request did wait: one that got a slot
    at once leaves its phase unended, and nothing is exported for it."""
    tracer, memory = make()
    rt = request_trace(tracer, "chat", "/v1/chat/completions", "rid", None, None)
    rt.start(QUEUE, {"sluice.queue.length": 0})
    rt.set(queue_ms=0)
    rt.finish(200, "success")
    [root] = memory.get_finished_spans()
    assert root.attributes is not None and root.attributes["sluice.queue_ms"] == 0


def _span(readable: ReadableSpan) -> trace.Span:
    return trace.NonRecordingSpan(readable.context)


def test_the_request_span_is_current_while_the_request_is_served() -> None:
    """So that instrumentation libraries (redis, httpx) add their spans to the trace."""
    tracer, memory = make()
    before = otel_context.get_current()
    rt = request_trace(tracer, "chat", "/v1/chat/completions", "rid", None, None)
    assert isinstance(rt, RequestTrace)
    inner = tracer.start_span("redis EVALSHA")  # what an instrumentation would do
    inner.end()
    rt.finish(200, "success")
    assert otel_context.get_current() == before
    spans = by_name(memory)
    assert spans["redis EVALSHA"].parent is not None
    assert spans["redis EVALSHA"].parent.span_id == spans["chat"].context.span_id


def test_an_unsampled_request_records_nothing_but_propagates() -> None:
    tracer, memory = make(ParentBased(ALWAYS_OFF))
    rt = request_trace(tracer, "chat", "/v1/chat/completions", "rid", None, None)
    assert isinstance(rt, Unsampled) and not rt.recording
    current = trace.get_current_span().get_span_context()
    [(_, value)] = rt.upstream_headers(rt.start(UPSTREAM))
    flags = int(current.trace_flags)
    assert value.decode() == f"00-{current.trace_id:032x}-{current.span_id:016x}-{flags:02x}"
    assert not flags & 1  # the sampled flag is off
    rt.finish(200, "success")
    assert not trace.get_current_span().get_span_context().is_valid
    assert memory.get_finished_spans() == ()
    # a sampled caller's decision is kept (parent based)
    rt = request_trace(tracer, "chat", "/v1/chat/completions", "rid", PARENT.encode(), None)
    assert isinstance(rt, RequestTrace)
    rt.finish(200, "success")
    assert len(memory.get_finished_spans()) == 1


def test_tracing_off_is_the_no_op() -> None:
    assert NO_TRACE.start(RESERVE) is None and NO_TRACE.start(UPSTREAM) is None
    assert NO_TRACE.upstream_headers(None) == []
    NO_TRACE.event(AUTH, **{"sluice.tenant.id": "acme"})
    NO_TRACE.end(None)
    NO_TRACE.finish(200, "success")


# ---- propagation -------------------------------------------------------------------------

def test_traceparent_and_extract_round_trip() -> None:
    tracer, memory = make()
    span = tracer.start_span("s")
    ctx = span.get_span_context()
    header = traceparent(span)
    # sampled (01), and the SDK's random trace id flag (02, W3C trace context level 2)
    assert header == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-03"
    assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-03", header)
    extracted = extract(header, "vendor=abc,other=1")
    assert extracted is not None
    remote_ctx = trace.get_current_span(extracted).get_span_context()
    assert (remote_ctx.trace_id, remote_ctx.span_id) == (ctx.trace_id, ctx.span_id)
    assert remote_ctx.is_remote and remote_ctx.trace_flags.sampled
    assert remote_ctx.trace_state.to_header() == "vendor=abc,other=1"
    child = tracer.start_span("next hop", extracted)
    child.end()
    [done] = memory.get_finished_spans()
    assert done.context.trace_id == ctx.trace_id and done.parent is not None
    assert done.parent.span_id == ctx.span_id and done.parent.is_remote
    assert done.context.trace_state.to_header() == "vendor=abc,other=1"


def test_traceparent_of_an_invalid_span_is_none() -> None:
    assert traceparent(trace.INVALID_SPAN) is None


@pytest.mark.parametrize("header", [
    None, "", "garbage", "00-xyz", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
    "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",
])
def test_extract_of_garbage_is_none(header: str | None) -> None:
    assert extract(header) is None


def test_the_callers_tracestate_travels_upstream_sampled_or_not() -> None:
    tracer, _ = make()
    rt = request_trace(tracer, "chat", "/v1/chat/completions", "rid", PARENT.encode(), b"vendor=abc")
    headers = dict(rt.upstream_headers(rt.start(UPSTREAM)))
    assert headers[b"tracestate"] == b"vendor=abc"
    rt.finish(200, "success")
    unsampled = PARENT[:-2] + "00"
    rt = request_trace(tracer, "chat", "/v1/chat/completions", "rid", unsampled.encode(), b"v=1")
    assert isinstance(rt, Unsampled)
    headers = dict(rt.upstream_headers(None))
    assert headers[b"tracestate"] == b"v=1" and headers[b"traceparent"].endswith(b"-00")
    rt.finish(200, "success")
    rt = request_trace(tracer, "chat", "/v1/chat/completions", "rid", None, None)
    assert [k for k, _ in rt.upstream_headers(rt.start(UPSTREAM))] == [b"traceparent"]
    rt.finish(200, "success")
