"""The lean tracing implementation: samplers, ids, parenting, span semantics, phases,
and W3C propagation."""

from __future__ import annotations

import random
import re

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)

from telemetry import extract, new_span_id, record_phase, traceparent
from telemetry.tracing import Sampler, Span, Tracer, TracerProvider, child_span

MASK64 = (1 << 64) - 1
REMOTE_TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
REMOTE_SPAN = 0x00F067AA0BA902B7


class Sink(list):
    """Collects every ended recording span, as BatchExporter would receive them."""

    def __call__(self, span: Span) -> None:
        self.append(span)


def make(sampler: str = "always_on", arg: float | None = None,
         seed: int | None = 1) -> tuple[Tracer, Sink]:
    sink = Sink()
    provider = TracerProvider(Sampler(sampler, arg), sink, seed=seed)
    return provider.get_tracer("test.scope", "1.0"), sink


def remote(sampled: bool, state: str | None = None) -> otel_context.Context:
    ctx = extract(f"00-{REMOTE_TRACE:032x}-{REMOTE_SPAN:016x}-{'01' if sampled else '00'}",
                  state)
    assert ctx is not None
    return ctx


def ctx_of(trace_id: int, sampled: bool = True, is_remote: bool = True) -> SpanContext:
    return SpanContext(trace_id, 0x1234, is_remote,
                       TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT))


# ---- samplers ----------------------------------------------------------------------------

def test_always_on_records_and_samples() -> None:
    tracer, sink = make("always_on")
    span = tracer.start_span("x")
    assert isinstance(span, Span) and span.is_recording()
    assert span.get_span_context().trace_flags.sampled
    span.end()
    assert sink == [span]


def test_always_off_returns_a_non_recording_span_with_a_valid_context() -> None:
    tracer, sink = make("always_off")
    span = tracer.start_span("x")
    assert isinstance(span, NonRecordingSpan) and not span.is_recording()
    ctx = span.get_span_context()
    assert ctx.is_valid and not ctx.trace_flags.sampled and not ctx.is_remote
    span.end()
    assert sink == []
    # its children share its trace id, so a traceparent still ties the hops together
    child = tracer.start_span("c", trace.set_span_in_context(span))
    assert child.get_span_context().trace_id == ctx.trace_id
    assert child.get_span_context().span_id != ctx.span_id


def test_traceidratio_zero_and_one() -> None:
    rng = random.Random(7)
    ids = [rng.getrandbits(128) for _ in range(1000)] + [1, MASK64, MASK64 << 64 | MASK64]
    zero, one = Sampler("traceidratio", 0.0), Sampler("traceidratio", 1.0)
    assert not any(zero.sample(None, t) for t in ids)
    assert all(one.sample(None, t) for t in ids)
    assert all(Sampler("traceidratio").sample(None, t) for t in ids)  # no arg: 1.0


def test_traceidratio_half_is_about_half_and_deterministic_per_trace_id() -> None:
    rng = random.Random(42)
    ids = [rng.getrandbits(128) for _ in range(4000)]
    half = Sampler("traceidratio", 0.5)
    decisions = [half.sample(None, t) for t in ids]
    assert 0.45 < sum(decisions) / len(ids) < 0.55
    # the same trace id always gets the same answer, from any sampler instance
    again = Sampler("traceidratio", 0.5)
    assert [again.sample(None, t) for t in ids] == decisions
    # the decision is the spec's: the low 64 bits against rate × 2^64
    assert decisions == [(t & MASK64) < (1 << 63) for t in ids]
    # so spans of one trace agree: a child under a non-parent-based ratio sampler
    assert [half.sample(ctx_of(t, sampled=not d), t) for t, d in zip(ids, decisions)] \
        == decisions


def test_traceidratio_through_the_tracer() -> None:
    tracer, _ = make("traceidratio", 0.5, seed=3)
    spans = [tracer.start_span("s") for _ in range(2000)]
    recording = [s for s in spans if s.is_recording()]
    assert 0.45 < len(recording) / len(spans) < 0.55
    for s in spans:
        ctx = s.get_span_context()
        assert ctx.trace_flags.sampled == s.is_recording()
        assert s.is_recording() == ((ctx.trace_id & MASK64) < (1 << 63))


def test_non_parent_based_samplers_ignore_the_parent() -> None:
    assert not Sampler("always_off").sample(ctx_of(5, sampled=True), 5)
    assert Sampler("always_on").sample(ctx_of(5, sampled=False), 5)
    tracer, _ = make("always_on")
    span = tracer.start_span("x", remote(sampled=False))
    assert span.is_recording()
    assert span.get_span_context().trace_id == REMOTE_TRACE


@pytest.mark.parametrize("name", ["parentbased_always_on", "parentbased_always_off",
                                  "parentbased_traceidratio"])
def test_parent_based_samplers_follow_a_remote_parent(name: str) -> None:
    tracer, _ = make(name, 0.0 if name.endswith("ratio") else None)
    sampled = tracer.start_span("in", remote(sampled=True))
    assert isinstance(sampled, Span) and sampled.is_recording()
    assert sampled.context.trace_id == REMOTE_TRACE
    assert sampled.parent_id == REMOTE_SPAN and sampled.parent_remote
    unsampled = tracer.start_span("in", remote(sampled=False))
    assert isinstance(unsampled, NonRecordingSpan)
    assert unsampled.get_span_context().trace_id == REMOTE_TRACE
    assert not unsampled.get_span_context().trace_flags.sampled


def test_parent_based_roots_use_the_root_sampler() -> None:
    assert make("parentbased_always_on")[0].start_span("r").is_recording()
    assert not make("parentbased_always_off")[0].start_span("r").is_recording()
    assert not make("parentbased_traceidratio", 0.0)[0].start_span("r").is_recording()
    assert make("parentbased_traceidratio", 1.0)[0].start_span("r").is_recording()


def test_parent_based_follows_a_local_parent_too() -> None:
    tracer, _ = make("parentbased_always_off")
    # a sampled local parent from another (always_on) provider
    parent = make("always_on")[0].start_span("p")
    child = tracer.start_span("c", trace.set_span_in_context(parent))
    assert child.is_recording()
    assert isinstance(child, Span) and not child.parent_remote


def test_unsampled_span_propagates_its_trace() -> None:
    tracer, _ = make("parentbased_always_on")
    span = tracer.start_span("in", remote(sampled=False))
    ctx = span.get_span_context()
    assert traceparent(span) == f"00-{REMOTE_TRACE:032x}-{ctx.span_id:016x}-00"
    with trace.use_span(span):
        inner = tracer.start_span("inner")
    assert not inner.is_recording()
    assert inner.get_span_context().trace_id == REMOTE_TRACE


# ---- ids ---------------------------------------------------------------------------------

def test_ids_are_unique_and_non_zero() -> None:
    tracer, _ = make("always_on", seed=None)
    spans = [tracer.start_span("s") for _ in range(3000)]
    trace_ids = {s.get_span_context().trace_id for s in spans}
    span_ids = {s.get_span_context().span_id for s in spans}
    assert len(trace_ids) == len(span_ids) == 3000
    assert 0 not in trace_ids and 0 not in span_ids
    assert all(s.get_span_context().is_valid for s in spans)
    ids = {new_span_id() for _ in range(3000)}
    assert len(ids) == 3000 and 0 not in ids and max(ids) <= MASK64


def test_an_rng_returning_zero_still_gives_valid_ids() -> None:
    class Zero(random.Random):
        def getrandbits(self, k: int) -> int:
            return 0

    tracer, _ = make("always_on")
    tracer._provider.rng = Zero()
    ctx = tracer.start_span("s").get_span_context()
    assert ctx.is_valid and ctx.trace_id != 0 and ctx.span_id != 0


def test_seeded_providers_repeat_their_ids() -> None:
    a = [make(seed=9)[0].start_span("s").get_span_context() for _ in range(2)]
    assert a[0].trace_id == a[1].trace_id and a[0].span_id == a[1].span_id


# ---- parenting ---------------------------------------------------------------------------

def test_parent_child_via_set_span_in_context() -> None:
    tracer, _ = make()
    parent = tracer.start_span("p")
    child = tracer.start_span("c", trace.set_span_in_context(parent))
    grandchild = tracer.start_span("g", trace.set_span_in_context(child))
    assert isinstance(parent, Span) and isinstance(child, Span) and isinstance(grandchild, Span)
    assert parent.parent_id == 0 and not parent.parent_remote
    assert child.parent_id == parent.context.span_id and not child.parent_remote
    assert grandchild.parent_id == child.context.span_id
    assert {s.context.trace_id for s in (parent, child, grandchild)} == {
        parent.context.trace_id}
    # an explicit empty context starts a new trace even inside a current span
    with trace.use_span(parent):
        fresh = tracer.start_span("fresh", otel_context.Context())
    assert isinstance(fresh, Span) and fresh.parent_id == 0
    assert fresh.context.trace_id != parent.context.trace_id


def test_invalid_parent_starts_a_root() -> None:
    tracer, _ = make()
    span = tracer.start_span("r", trace.set_span_in_context(trace.INVALID_SPAN))
    assert isinstance(span, Span) and span.parent_id == 0


def test_start_as_current_span_nests_and_ends() -> None:
    tracer, sink = make()
    assert trace.get_current_span() is trace.INVALID_SPAN
    with tracer.start_as_current_span("outer", kind=SpanKind.SERVER,
                                      attributes={"a": 1}) as outer:
        assert trace.get_current_span() is outer
        with tracer.start_as_current_span("inner") as inner:
            assert trace.get_current_span() is inner
            assert inner.parent_id == outer.context.span_id
            assert inner.context.trace_id == outer.context.trace_id
        assert trace.get_current_span() is outer
        assert sink == [inner]
    assert trace.get_current_span() is trace.INVALID_SPAN
    assert sink == [inner, outer]
    assert outer.end_ns >= outer.start_ns > 0 and not outer.is_recording()
    assert outer.kind_code == 2 and outer.attributes == {"a": 1}


def test_start_as_current_span_records_an_exception() -> None:
    tracer, sink = make()
    with pytest.raises(ValueError, match="bad input"), tracer.start_as_current_span("boom"):
        raise ValueError("bad input")
    [span] = sink
    [(name, t_ns, attrs)] = span.events
    assert name == "exception" and t_ns > 0
    assert attrs["exception.type"] == "ValueError"
    assert attrs["exception.message"] == "bad input"
    assert span.status_code == 2 and "bad input" in span.status_message
    assert span.end_ns > 0
    assert trace.get_current_span() is trace.INVALID_SPAN


def test_start_as_current_span_without_recording_the_exception() -> None:
    tracer, sink = make()
    with pytest.raises(KeyError), tracer.start_as_current_span(
            "quiet", record_exception=False, set_status_on_exception=False):
        raise KeyError("k")
    [span] = sink
    assert span.events == [] and span.status_code == 0


def test_start_as_current_span_end_on_exit_false() -> None:
    tracer, sink = make()
    with tracer.start_as_current_span("open", end_on_exit=False) as span:
        pass
    assert sink == [] and span.is_recording()
    span.end()
    assert sink == [span]


def test_start_as_current_span_unsampled_is_current_and_propagates() -> None:
    tracer, sink = make("always_off")
    with tracer.start_as_current_span("x") as span:
        assert trace.get_current_span() is span
        assert traceparent(span) is not None
    assert sink == []


# ---- span semantics ----------------------------------------------------------------------

def test_nothing_changes_after_end() -> None:
    tracer, sink = make()
    span = tracer.start_span("s", attributes={"k": "v"})
    assert isinstance(span, Span)
    span.end(1_000)
    assert span.end_ns == 1_000 and not span.is_recording()
    span.set_attribute("late", 1)
    span.set_attributes({"late2": 2, "k": "changed"})
    span.add_event("late")
    span.add_link(ctx_of(5))
    span.update_name("renamed")
    span.set_status(StatusCode.ERROR, "late")
    span.record_exception(RuntimeError("late"))
    span.end(2_000)
    assert span.attributes == {"k": "v"} and span.events == [] and list(span.links) == []
    assert span.name == "s" and span.status_code == 0 and span.end_ns == 1_000
    assert sink == [span]  # ended (and exported) once


def test_attribute_count_limit() -> None:
    tracer, _ = make()
    one = tracer.start_span("one")
    for i in range(200):
        one.set_attribute(f"k{i}", i)
    assert list(one.attributes) == [f"k{i}" for i in range(128)]
    one.set_attribute("k5", "overwritten")  # an existing key still updates at the limit
    assert one.attributes["k5"] == "overwritten" and len(one.attributes) == 128

    bulk = tracer.start_span("bulk")
    bulk.set_attributes({f"k{i}": i for i in range(200)})
    assert len(bulk.attributes) == 128

    bulk2 = tracer.start_span("bulk2", attributes={"a": 1})
    bulk2.set_attributes({f"k{i}": i for i in range(127)})  # exactly at the limit
    assert len(bulk2.attributes) == 128
    bulk2.set_attributes({"over": 1})
    assert "over" not in bulk2.attributes

    start = tracer.start_span("start", attributes={f"k{i}": i for i in range(200)})
    assert list(start.attributes) == [f"k{i}" for i in range(128)]


def test_none_attribute_values_are_ignored() -> None:
    tracer, _ = make()
    span = tracer.start_span("s")
    span.set_attribute("gone", None)
    assert "gone" not in span.attributes


def test_events_and_links() -> None:
    tracer, _ = make()
    link = Link(ctx_of(77), {"why": "retry"})
    span = tracer.start_span("s", links=[link])
    assert isinstance(span, Span)
    span.add_event("first", {"n": 1}, timestamp=123)
    span.add_event("second")
    span.add_link(ctx_of(88))
    span.add_link(SpanContext(0, 0, False))  # invalid: ignored
    assert span.events[0] == ("first", 123, {"n": 1})
    assert span.events[1][0] == "second" and span.events[1][1] > 0 and span.events[1][2] is None
    assert [lk.context.trace_id for lk in span.links] == [77, 88]
    for i in range(200):
        span.add_event(f"e{i}")
    assert len(span.events) == 128


def test_set_status_semantics() -> None:
    tracer, _ = make()
    span = tracer.start_span("s")
    assert isinstance(span, Span)
    span.set_status(StatusCode.ERROR, "first failure")
    assert (span.status_code, span.status_message) == (2, "first failure")
    span.set_status(StatusCode.UNSET)  # ignored, not a reset
    assert (span.status_code, span.status_message) == (2, "first failure")
    span.set_status(Status(StatusCode.ERROR, "second"))
    assert (span.status_code, span.status_message) == (2, "second")
    span.set_status(StatusCode.OK, "description dropped for OK")
    assert (span.status_code, span.status_message) == (1, "")
    span.set_status(StatusCode.ERROR, "too late")  # OK is final
    assert (span.status_code, span.status_message) == (1, "")

    other = tracer.start_span("o")
    other.set_status(Status(StatusCode.OK))
    other.set_status(Status(StatusCode.ERROR, "no"))
    assert (other.status_code, other.status_message) == (1, "")
    err = tracer.start_span("e")
    err.set_status(StatusCode.ERROR)
    assert (err.status_code, err.status_message) == (2, "")


def test_record_exception_attributes() -> None:
    tracer, _ = make()
    span = tracer.start_span("s")
    span.record_exception(KeyError("missing"), {"extra": 1}, timestamp=55)
    [(name, t_ns, attrs)] = span.events
    assert (name, t_ns) == ("exception", 55)
    assert attrs == {"exception.type": "KeyError", "exception.message": "'missing'",
                     "extra": 1}
    assert span.status_code == 0  # recording an exception does not set the status


# ---- phases ------------------------------------------------------------------------------

def test_record_phase_batches_a_child_with_its_parent() -> None:
    tracer, sink = make()
    parent = tracer.start_span("request")
    assert isinstance(parent, Span)
    record_phase(tracer, parent, "sluice.queue.wait", 100, 250, {"queue": "u1"},
                 kind=SpanKind.CLIENT, span_id=0xABC)
    record_phase(tracer, parent, "sluice.relay", 250, 900)
    assert sink == []  # nothing goes anywhere before the parent ends
    [first, second] = parent.children
    # plain tuples (name, span id, start, end, attributes, kind code): marshal-ready
    assert type(first) is tuple
    assert first == ("sluice.queue.wait", 0xABC, 100, 250, {"queue": "u1"}, 3)
    assert second[1] not in (0, first[1]) and second[5] == 1
    parent.end()
    assert sink == [parent]  # one queue item: the parent carrying its children
    as_span = child_span(parent, first)
    assert as_span.context.trace_id == parent.context.trace_id
    assert as_span.context.span_id == 0xABC
    assert as_span.parent_id == parent.context.span_id and not as_span.parent_remote
    assert (as_span.start_ns, as_span.end_ns, as_span.kind_code) == (100, 250, 3)


def test_record_phase_on_noop_or_non_recording_parents_does_nothing() -> None:
    tracer, sink = make("always_on")
    record_phase(trace.NoOpTracer(), trace.INVALID_SPAN, "p", 1, 2)
    record_phase(tracer, trace.INVALID_SPAN, "p", 1, 2, {"a": 1})
    unsampled = NonRecordingSpan(ctx_of(99, sampled=False, is_remote=False))
    record_phase(tracer, unsampled, "p", 1, 2)
    off_tracer, off_sink = make("always_off")
    off_parent = off_tracer.start_span("root")
    record_phase(off_tracer, off_parent, "p", 1, 2)
    record_phase(tracer, off_parent, "p", 1, 2)
    assert sink == [] and off_sink == []


def test_record_phase_on_another_implementations_span_goes_through_the_tracer() -> None:
    tracer, sink = make()
    sdk_parent = SdkTracerProvider().get_tracer("sdk").start_span("sdk-parent")
    record_phase(tracer, sdk_parent, "phase", 10, 20, {"k": "v"}, kind=SpanKind.CLIENT)
    [span] = sink
    assert span.name == "phase" and (span.start_ns, span.end_ns) == (10, 20)
    assert span.parent_id == sdk_parent.get_span_context().span_id
    assert span.context.trace_id == sdk_parent.get_span_context().trace_id
    assert span.attributes == {"k": "v"} and span.kind_code == 3
    sdk_parent.end()


def test_a_child_after_the_parent_ended_is_exported_alone() -> None:
    tracer, sink = make()
    parent = tracer.start_span("request")
    parent.end()
    record_phase(tracer, parent, "late", 500, 600, {"x": 1}, span_id=0x77)
    assert len(sink) == 2 and sink[0] is parent and parent.children == []
    late = sink[1]
    assert isinstance(late, Span) and late.name == "late"
    assert late.context.span_id == 0x77
    assert late.context.trace_id == parent.context.trace_id
    assert late.parent_id == parent.context.span_id
    assert (late.start_ns, late.end_ns) == (500, 600) and not late.is_recording()
    assert late.attributes == {"x": 1} and late.children == []


# ---- propagation -------------------------------------------------------------------------

def test_traceparent_and_extract_round_trip() -> None:
    tracer, _ = make()
    span = tracer.start_span("s")
    ctx = span.get_span_context()
    header = traceparent(span)
    assert header == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01"
    assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-01", header)
    extracted = extract(header, "vendor=abc,other=1")
    assert extracted is not None
    remote_ctx = trace.get_current_span(extracted).get_span_context()
    assert (remote_ctx.trace_id, remote_ctx.span_id) == (ctx.trace_id, ctx.span_id)
    assert remote_ctx.is_remote and remote_ctx.trace_flags.sampled
    assert remote_ctx.trace_state.to_header() == "vendor=abc,other=1"
    # the next hop's span joins the trace, carrying the trace state along
    child = make()[0].start_span("next hop", extracted)
    assert isinstance(child, Span)
    assert child.context.trace_id == ctx.trace_id and child.parent_id == ctx.span_id
    assert child.parent_remote
    assert child.context.trace_state.to_header() == "vendor=abc,other=1"


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
