"""Span export: the hand-written OTLP encoder (checked by decoding with opentelemetry-proto),
the batch exporter's queue and counters, and the transports against the test receivers."""

from __future__ import annotations

import io
import json
import logging
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import (
    AnyValue,
    ArrayValue,
    InstrumentationScope,
    KeyValue,
    KeyValueList,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1 import trace_pb2 as pb
from opentelemetry.trace import Link, SpanContext, SpanKind, StatusCode, TraceFlags

from telemetry import extract, record_phase
from telemetry.bench.otlp_sink import OtlpGrpcReceiver, OtlpReceiver
from telemetry.export import BatchExporter, Console, OtlpGrpc, OtlpHttp
from telemetry.otlp import Encoder
from telemetry.tracing import Sampler, Span, Tracer, TracerProvider

RESOURCE = {"service.name": "svc", "process.pid": 42, "ratio": 0.5}


def tracer_for(sink: Callable[[Span], None], scope: str = "test.scope",
               version: str | None = "1.0") -> Tracer:
    return TracerProvider(Sampler("always_on"), sink, seed=5).get_tracer(scope, version)


class Collect(list):
    def __call__(self, span: Span) -> None:
        self.append(span)


# ---- reference protos ----------------------------------------------------------------------

def av(v: Any) -> AnyValue:
    if isinstance(v, str):
        return AnyValue(string_value=v)
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    if isinstance(v, bytes):
        return AnyValue(bytes_value=v)
    if isinstance(v, dict):
        return AnyValue(kvlist_value=KeyValueList(values=kvs(v)))
    return AnyValue(array_value=ArrayValue(values=[av(x) for x in v]))


def kvs(d: dict[str, Any]) -> list[KeyValue]:
    return [KeyValue(key=k, value=av(v)) for k, v in d.items()]


def py(v: AnyValue) -> tuple[str, Any]:
    """(which oneof field, python value), so True, 1 and 1.0 stay apart."""
    which = v.WhichOneof("value")
    if which == "array_value":
        return which, [py(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return which, {kv.key: py(kv.value) for kv in v.kvlist_value.values}
    return which, getattr(v, which)


def b16(n: int) -> bytes:
    return n.to_bytes(16, "big")


def b8(n: int) -> bytes:
    return n.to_bytes(8, "big")


def decode(enc: Encoder, spans: Sequence[Span]) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest.FromString(enc.request([enc.prepare(s) for s in spans]))


def only_spans(req: ExportTraceServiceRequest) -> list[pb.Span]:
    return [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]


# ---- the encoder ---------------------------------------------------------------------------

ATTRS: dict[str, Any] = {
    "s": "text", "empty": "", "unicode": "naïve ✓", "t": True, "f": False,
    "i": 7, "zero": 0, "neg": -5, "big": 2**31 + 7, "huge": 2**62 + 1, "min64": -(2**63),
    "negbig": -(2**40), "fl": 1.5, "negfl": -0.25, "fl_int": 3.0,
    "strs": ["a", "b"], "ints": [1, -2, 3], "bools": [True, False], "floats": [0.5],
    "tuple": ("x", "y"), "dict": {"k": "v", "n": 1, "nested": {"deep": True}},
    "raw": b"\x00\x01\xff", "long": "x" * 300, "k" * 200: 12,
}


def test_encoded_span_decodes_to_exactly_what_was_put_in() -> None:
    sink = Collect()
    tracer = tracer_for(sink)
    link_ctx = SpanContext(0x1111, 0x2222, True, TraceFlags(TraceFlags.SAMPLED))
    span = tracer.start_span("GET /v1/chat", kind=SpanKind.SERVER,
                             attributes={**ATTRS, "none": None},
                             links=[Link(link_ctx, {"why": "retry", "n": 2})], start_time=1_000)
    assert isinstance(span, Span)
    span.add_link(SpanContext(0x3333, 0x4444, False))
    span.add_event("ev", {"k": "v", "n": 3, "ok": True}, timestamp=1_500)
    span.add_event("bare", timestamp=1_600)
    span.set_status(StatusCode.ERROR, "boom")
    span.end(2_000)
    req = decode(Encoder(RESOURCE), [span])
    [rs] = req.resource_spans
    assert rs.resource == Resource(attributes=kvs(RESOURCE))
    [ss] = rs.scope_spans
    assert ss.scope == InstrumentationScope(name="test.scope", version="1.0")
    [got] = ss.spans
    ctx = span.context
    expected = pb.Span(
        trace_id=b16(ctx.trace_id), span_id=b8(ctx.span_id), name="GET /v1/chat",
        kind=pb.Span.SPAN_KIND_SERVER, start_time_unix_nano=1_000, end_time_unix_nano=2_000,
        attributes=kvs(ATTRS),  # "none" is dropped, not sent as "None"
        events=[pb.Span.Event(time_unix_nano=1_500, name="ev",
                              attributes=kvs({"k": "v", "n": 3, "ok": True})),
                pb.Span.Event(time_unix_nano=1_600, name="bare")],
        links=[pb.Span.Link(trace_id=b16(0x1111), span_id=b8(0x2222),
                            attributes=kvs({"why": "retry", "n": 2})),
               pb.Span.Link(trace_id=b16(0x3333), span_id=b8(0x4444))],
        status=pb.Status(code=pb.Status.STATUS_CODE_ERROR, message="boom"),
        flags=0x101)
    assert got == expected
    # spot checks that do not rely on the reference builder
    values = {kv.key: py(kv.value) for kv in got.attributes}
    assert values["t"] == ("bool_value", True) and values["i"] == ("int_value", 7)
    assert values["neg"] == ("int_value", -5) and values["big"] == ("int_value", 2**31 + 7)
    assert values["min64"] == ("int_value", -(2**63))
    assert values["fl_int"] == ("double_value", 3.0)
    assert values["raw"] == ("bytes_value", b"\x00\x01\xff")
    assert values["dict"][1]["nested"] == ("kvlist_value", {"deep": ("bool_value", True)})
    assert "none" not in values


def test_large_span_bodies_use_multi_byte_lengths() -> None:
    sink = Collect()
    span = tracer_for(sink).start_span("big", attributes={"blob": "y" * 70_000, "n": 1})
    span.end(5)
    [got] = only_spans(decode(Encoder({}), [span]))
    assert {kv.key: py(kv.value) for kv in got.attributes} == {
        "blob": ("string_value", "y" * 70_000), "n": ("int_value", 1)}


@pytest.mark.parametrize(("kind", "code"), [
    (SpanKind.INTERNAL, 1), (SpanKind.SERVER, 2), (SpanKind.CLIENT, 3),
    (SpanKind.PRODUCER, 4), (SpanKind.CONSUMER, 5)])
def test_kind_mapping(kind: SpanKind, code: int) -> None:
    sink = Collect()
    tracer = tracer_for(sink)
    span = tracer.start_span("s", kind=kind)
    record_phase(tracer, span, "phase", 1, 2, kind=kind)
    span.end()
    assert [s.kind for s in only_spans(decode(Encoder({}), [span]))] == [code, code]


def test_status_ok_and_unset() -> None:
    sink = Collect()
    tracer = tracer_for(sink)
    ok = tracer.start_span("ok")
    ok.set_status(StatusCode.OK)
    ok.end()
    unset = tracer.start_span("unset")
    unset.end()
    got_ok, got_unset = only_spans(decode(Encoder({}), [ok, unset]))
    assert got_ok.status == pb.Status(code=pb.Status.STATUS_CODE_OK)
    assert not got_unset.HasField("status")


def test_batched_children_carry_the_parents_trace_and_id() -> None:
    sink = Collect()
    tracer = tracer_for(sink)
    parent = tracer.start_span("request", start_time=100)
    record_phase(tracer, parent, "sluice.queue.wait", 110, 150, {"queue": "u1", "n": 2},
                 span_id=0xAAA)
    record_phase(tracer, parent, "sluice.upstream", 150, 900, kind=SpanKind.CLIENT,
                 span_id=0xBBB)
    parent.end(1_000)
    req = decode(Encoder({}), [parent])
    [ss] = req.resource_spans[0].scope_spans
    tid, sid = b16(parent.context.trace_id), b8(parent.context.span_id)
    assert list(ss.spans) == [
        pb.Span(trace_id=tid, span_id=sid, name="request", kind=1, start_time_unix_nano=100,
                end_time_unix_nano=1_000, flags=0x101),
        pb.Span(trace_id=tid, span_id=b8(0xAAA), parent_span_id=sid, name="sluice.queue.wait",
                kind=1, start_time_unix_nano=110, end_time_unix_nano=150,
                attributes=kvs({"queue": "u1", "n": 2}), flags=0x101),
        pb.Span(trace_id=tid, span_id=b8(0xBBB), parent_span_id=sid, name="sluice.upstream",
                kind=3, start_time_unix_nano=150, end_time_unix_nano=900, flags=0x101),
    ]


def test_parent_ids_flags_and_trace_state_from_a_remote_parent() -> None:
    sink = Collect()
    tracer = tracer_for(sink)
    remote = extract("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "vendor=abc")
    server = tracer.start_span("server", remote, kind=SpanKind.SERVER)
    local = tracer.start_span("local", trace.set_span_in_context(server))
    record_phase(tracer, server, "phase", 1, 2, span_id=0xC)
    local.end()
    server.end()
    got_local, got_server, got_phase = only_spans(decode(Encoder({}), [local, server]))
    assert got_server.trace_id.hex() == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert got_server.parent_span_id.hex() == "00f067aa0ba902b7"
    assert got_server.flags == 0x301  # sampled, has-is-remote, parent is remote
    assert got_local.parent_span_id == got_server.span_id
    assert got_local.flags == 0x101  # local parent
    assert got_phase.parent_span_id == got_server.span_id and got_phase.flags == 0x101
    assert {s.trace_state for s in (got_server, got_local, got_phase)} == {"vendor=abc"}
    root = tracer.start_span("root")
    root.end()
    [got_root] = only_spans(decode(Encoder({}), [root]))
    assert got_root.parent_span_id == b"" and got_root.flags == 0x101
    assert got_root.trace_state == ""


def test_spans_are_grouped_by_scope() -> None:
    sink = Collect()
    provider = TracerProvider(Sampler("always_on"), sink, seed=1)
    a, b = provider.get_tracer("scope.a", "1.0"), provider.get_tracer("scope.b")
    for tracer, name in ((a, "a1"), (b, "b1"), (a, "a2")):
        tracer.start_span(name).end()
    req = decode(Encoder(RESOURCE), sink)
    [rs] = req.resource_spans
    assert rs.resource == Resource(attributes=kvs(RESOURCE))
    assert [(ss.scope.name, ss.scope.version, [s.name for s in ss.spans])
            for ss in rs.scope_spans] == [("scope.a", "1.0", ["a1", "a2"]),
                                          ("scope.b", "", ["b1"])]
    assert not rs.scope_spans[1].scope.version
    # and again from the encoder's caches: the same bytes
    enc = Encoder(RESOURCE)
    first = enc.request([enc.prepare(s) for s in sink])
    assert enc.request([enc.prepare(s) for s in sink]) == first


def test_cached_encodings_keep_bool_int_float_and_str_apart() -> None:
    sink = Collect()
    tracer = tracer_for(sink)
    values: list[Any] = [True, 1, 1.0, "1", True, 0, False, 0.0, "True", 1, -1, 2**40]
    for v in values:
        span = tracer.start_span("s", attributes={"v": v, "w": "shared"})
        span.set_attribute("u", "shared")  # same string value under another key
        span.end()
    enc = Encoder({})
    one_by_one = [only_spans(decode(enc, [s]))[0] for s in sink]
    together = only_spans(decode(enc, sink))
    kinds = {bool: "bool_value", int: "int_value", float: "double_value", str: "string_value"}
    for got in (one_by_one, together):
        assert [py(s.attributes[0].value) for s in got] == [(kinds[type(v)], v)
                                                            for v in values]
        assert {(s.attributes[1].key, py(s.attributes[1].value)) for s in got} == {
            ("w", ("string_value", "shared"))}
        assert {(s.attributes[2].key, py(s.attributes[2].value)) for s in got} == {
            ("u", ("string_value", "shared"))}


def test_cached_encodings_keep_array_values_apart() -> None:
    """Tuples of strings are cached like strings; (1,) and (True,) compare equal, so
    tuples of anything else, and unhashable lists, are encoded each time."""
    sink = Collect()
    tracer = tracer_for(sink)
    values: list[Any] = [("a",), ["a"], (1,), (True,), (1.0,), ("a",), [1], (True,), (1,),
                         ("a", "b"), ["a", "b"]]
    for v in values:
        span = tracer.start_span("s", attributes={"k": "shared", "v": v, "n": 7})
        span.end()
    enc = Encoder({})
    for got in ([only_spans(decode(enc, [s]))[0] for s in sink], only_spans(decode(enc, sink))):
        assert [py(s.attributes[1].value) for s in got] == [py(av(v)) for v in values]
        assert {py(s.attributes[0].value) for s in got} == {("string_value", "shared")}
        assert {py(s.attributes[2].value) for s in got} == {("int_value", 7)}


# ---- BatchExporter -------------------------------------------------------------------------

class FakeTransport:
    def __init__(self, fail: Exception | None = None, fail_prepare: bool = False) -> None:
        self.batches: list[list[str]] = []
        self.fail = fail
        self.fail_prepare = fail_prepare
        self.closed = False

    def prepare(self, span: Span) -> str:
        if self.fail_prepare:
            raise ValueError("cannot encode")
        return span.name

    def send(self, items: Sequence[str]) -> None:
        if self.fail is not None:
            raise self.fail
        self.batches.append(list(items))

    def close(self) -> None:
        self.closed = True

    @property
    def sent(self) -> list[str]:
        return [name for batch in self.batches for name in batch]


@pytest.fixture
def exporters() -> Iterator[list[BatchExporter]]:
    made: list[BatchExporter] = []
    yield made
    for exp in made:
        exp.shutdown(2)


def end_spans(tracer: Tracer, names: Sequence[str], children: int = 0) -> None:
    for name in names:
        span = tracer.start_span(name)
        for i in range(children):
            record_phase(tracer, span, f"{name}.c{i}", 1, 2)
        span.end()


def test_force_flush_delivers_everything(exporters: list[BatchExporter]) -> None:
    fake = FakeTransport()
    exp = BatchExporter(fake, max_queue=1000, max_batch=10, schedule_delay_s=60)
    exporters.append(exp)
    tracer = tracer_for(exp)
    names = [f"s{i}" for i in range(25)]
    end_spans(tracer, names[:20])
    end_spans(tracer, names[20:], children=2)
    assert exp.force_flush(5)
    assert fake.sent == names
    assert exp.exported == 25 + 5 * 2
    assert exp.dropped == exp.failed == 0
    assert all(len(batch) <= 10 for batch in fake.batches) and len(fake.batches) >= 3
    assert exp.force_flush(5)  # nothing queued: still True
    assert exp.exported == 35


def test_a_full_batch_wakes_the_export_thread(exporters: list[BatchExporter]) -> None:
    fake = FakeTransport()
    exp = BatchExporter(fake, max_queue=100, max_batch=4, schedule_delay_s=60)
    exporters.append(exp)
    end_spans(tracer_for(exp), ["a", "b", "c", "d"])
    deadline = time.monotonic() + 5
    while exp.exported < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake.sent == ["a", "b", "c", "d"]  # without a flush, long before the 60 s delay


def test_a_full_queue_drops_and_counts(exporters: list[BatchExporter]) -> None:
    fake = FakeTransport()
    exp = BatchExporter(fake, max_queue=5, max_batch=100, schedule_delay_s=60)
    exporters.append(exp)
    tracer = tracer_for(exp)
    end_spans(tracer, ["k0", "k1", "k2", "k3", "k4"])
    end_spans(tracer, ["d0", "d1"])  # never raises into end()
    end_spans(tracer, ["d2"], children=2)
    assert exp.dropped == 2 + 3
    assert exp.force_flush(5)
    assert fake.sent == ["k0", "k1", "k2", "k3", "k4"]
    assert exp.exported == 5 and exp.failed == 0


def test_transport_failures_are_counted_and_logged_at_most_every_30s(
        exporters: list[BatchExporter], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sluice.telemetry")
    now = [1000.0]
    fake = FakeTransport(fail=RuntimeError("collector down"))
    exp = BatchExporter(fake, schedule_delay_s=60, clock=lambda: now[0])
    exporters.append(exp)
    tracer = tracer_for(exp)

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.name == "sluice.telemetry" and r.levelno == logging.WARNING]

    end_spans(tracer, ["a", "b"])
    end_spans(tracer, ["c"], children=1)  # end() never sees the failure
    assert exp.force_flush(5)  # a failed batch still leaves the queue
    assert (exp.failed, exp.exported) == (4, 0)
    [first] = warnings()
    assert "span export failed" in first and "RuntimeError: collector down" in first
    assert "(4 spans dropped" in first

    now[0] += 29  # within 30 s of the last message: counted, not logged
    end_spans(tracer, ["d", "e"])
    assert exp.force_flush(5)
    assert exp.failed == 6 and len(warnings()) == 1

    now[0] += 2  # 31 s after the first message
    end_spans(tracer, ["f"])
    assert exp.force_flush(5)
    assert exp.failed == 7
    assert len(warnings()) == 2
    assert "(3 spans dropped since the last message)" in warnings()[1]


def test_an_encoding_failure_never_raises_into_end(exporters: list[BatchExporter]) -> None:
    fake = FakeTransport(fail_prepare=True)
    exp = BatchExporter(fake, schedule_delay_s=60)
    exporters.append(exp)
    end_spans(tracer_for(exp), ["x"], children=2)
    assert exp.failed == 3
    assert exp.force_flush(5) and fake.batches == [] and exp.exported == 0


def test_shutdown_flushes_and_closes() -> None:
    fake = FakeTransport()
    exp = BatchExporter(fake, schedule_delay_s=60)
    end_spans(tracer_for(exp), ["a", "b", "c"])
    exp.shutdown(5)
    assert fake.sent == ["a", "b", "c"] and exp.exported == 3
    assert fake.closed and not exp._thread.is_alive()


# ---- transports ----------------------------------------------------------------------------

@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as rx:
        yield rx


def sample_spans(tracer: Tracer) -> Span:
    span = tracer.start_span("request", kind=SpanKind.SERVER,
                             attributes={"tenant": "t1", "n": 3}, start_time=1_000)
    assert isinstance(span, Span)
    span.add_event("first_token", {"ttft_ms": 12.5}, timestamp=1_200)
    record_phase(tracer, span, "sluice.queue.wait", 1_010, 1_100, {"queue": "u1"},
                 span_id=0xABC)
    span.set_status(StatusCode.ERROR, "upstream 500")
    span.end(2_000)
    return span


def test_otlp_http_delivers_to_the_receiver(receiver: OtlpReceiver,
                                            exporters: list[BatchExporter]) -> None:
    resource = {"service.name": "svc-http", "process.pid": 7}
    transport = OtlpHttp(receiver.endpoint + "/v1/traces", resource, {"x-api-key": "k"},
                         timeout_s=5)
    exp = BatchExporter(transport, schedule_delay_s=60)
    exporters.append(exp)
    span = sample_spans(tracer_for(exp, scope="sluice.gateway"))
    assert exp.force_flush(5)
    assert exp.exported == 2 and exp.failed == 0
    got = {s.name: s for s in receiver.wait_for(lambda s: len(s) >= 2, 5)}
    assert set(got) == {"request", "sluice.queue.wait"}
    root, phase = got["request"], got["sluice.queue.wait"]
    assert root.trace_id == f"{span.context.trace_id:032x}"
    assert root.span_id == f"{span.context.span_id:016x}" and root.parent_span_id is None
    assert (root.kind, root.start_ns, root.end_ns) == (2, 1_000, 2_000)
    assert root.attributes == {"tenant": "t1", "n": 3}
    assert [(e.name, e.time_ns, e.attributes) for e in root.events] == [
        ("first_token", 1_200, {"ttft_ms": 12.5})]
    assert (root.status_code, root.status_message) == (2, "upstream 500")
    assert root.resource == resource and root.scope == "sluice.gateway"
    assert root.flags == 0x101
    assert phase.trace_id == root.trace_id and phase.parent_span_id == root.span_id
    assert phase.span_id == f"{0xABC:016x}" and phase.attributes == {"queue": "u1"}
    assert phase.resource["service.name"] == "svc-http"
    # a second batch reuses the kept-alive connection
    end_spans(tracer_for(exp), ["again"])
    assert exp.force_flush(5) and exp.exported == 3
    receiver.wait_for(lambda s: any(x.name == "again" for x in s), 5)


def test_otlp_http_gzip(receiver: OtlpReceiver) -> None:
    transport = OtlpHttp(receiver.endpoint + "/v1/traces", {"service.name": "svc-gz"}, {},
                         timeout_s=5, compress=True)
    sink = Collect()
    tracer = tracer_for(sink)
    end_spans(tracer, ["gz"])
    sink[0].set_attribute("ignored", 1)  # ended: no effect
    span = tracer.start_span("gz-big", attributes={"blob": "ab" * 5_000})
    span.end()
    items = [transport.prepare(s) for s in (sink[0], span)]
    raw = transport.encoder.request(items)
    transport.send(items)
    transport.close()
    got = receiver.wait_for(lambda s: len(s) >= 2, 5)
    assert sorted(s.name for s in got) == ["gz", "gz-big"]
    assert next(s for s in got if s.name == "gz-big").attributes == {"blob": "ab" * 5_000}
    assert got[0].resource == {"service.name": "svc-gz"}
    assert receiver.bytes_received < len(raw) / 10  # it went compressed


def test_otlp_http_error_status_raises_and_is_counted(receiver: OtlpReceiver,
                                                       exporters: list[BatchExporter]) -> None:
    transport = OtlpHttp(receiver.endpoint + "/v1/traces", {}, {}, timeout_s=5)
    sink = Collect()
    end_spans(tracer_for(sink), ["x"])
    receiver.status = 503
    with pytest.raises(RuntimeError, match="HTTP 503"):
        transport.send([transport.prepare(sink[0])])
    exp = BatchExporter(transport, schedule_delay_s=60)
    exporters.append(exp)
    end_spans(tracer_for(exp), ["y", "z"])
    assert exp.force_flush(5)
    assert (exp.failed, exp.exported) == (2, 0)
    assert receiver.spans() == []
    receiver.status = 200  # the collector is back: the same transport delivers again
    end_spans(tracer_for(exp), ["back"])
    assert exp.force_flush(5) and exp.exported == 1
    assert [s.name for s in receiver.wait_for(bool, 5)] == ["back"]


def test_otlp_http_to_a_closed_port_fails_fast(exporters: list[BatchExporter]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    transport = OtlpHttp(f"http://127.0.0.1:{port}/v1/traces", {}, {}, timeout_s=1)
    sink = Collect()
    end_spans(tracer_for(sink), ["x"])
    t0 = time.monotonic()
    with pytest.raises(OSError):
        transport.send([transport.prepare(sink[0])])
    assert time.monotonic() - t0 < 2
    exp = BatchExporter(transport, schedule_delay_s=60)
    exporters.append(exp)
    end_spans(tracer_for(exp), ["y"])
    t0 = time.monotonic()
    assert exp.force_flush(5)
    assert time.monotonic() - t0 < 2
    assert (exp.failed, exp.exported) == (1, 0)


def test_otlp_grpc_delivers_to_the_receiver(exporters: list[BatchExporter]) -> None:
    with OtlpGrpcReceiver() as rx:
        resource = {"service.name": "svc-grpc"}
        transport = OtlpGrpc(rx.endpoint, resource, {"X-Api-Key": "k"}, timeout_s=5)
        exp = BatchExporter(transport, schedule_delay_s=60)
        exporters.append(exp)
        span = sample_spans(tracer_for(exp))
        assert exp.force_flush(5)
        assert exp.exported == 2 and exp.failed == 0
        got = {s.name: s for s in rx.wait_for(lambda s: len(s) >= 2, 5)}
        assert set(got) == {"request", "sluice.queue.wait"}
        assert got["request"].span_id == f"{span.context.span_id:016x}"
        assert got["request"].resource == resource
        assert got["request"].attributes == {"tenant": "t1", "n": 3}
        assert got["sluice.queue.wait"].parent_span_id == got["request"].span_id
        rx.status = 503
        sink = Collect()
        end_spans(tracer_for(sink), ["rejected"])
        with pytest.raises(grpc.RpcError):
            transport.send([transport.prepare(sink[0])])
        end_spans(tracer_for(exp), ["rejected-too"])
        assert exp.force_flush(5) and exp.failed == 1
        exp.shutdown(2)


def test_console_writes_one_json_line_per_span(exporters: list[BatchExporter]) -> None:
    stream = io.StringIO()
    exp = BatchExporter(Console({"service.name": "svc-console"}, stream), schedule_delay_s=60)
    exporters.append(exp)
    tracer = tracer_for(exp, scope="sluice.console")
    parent = sample_spans(tracer)
    end_spans(tracer, ["second root"])
    assert exp.force_flush(5) and exp.exported == 3
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [d["name"] for d in lines] == ["request", "sluice.queue.wait", "second root"]
    root, phase, other = lines
    assert root["trace_id"] == f"{parent.context.trace_id:032x}"
    assert root["span_id"] == f"{parent.context.span_id:016x}"
    assert root["parent_span_id"] is None and other["parent_span_id"] is None
    assert phase["trace_id"] == root["trace_id"] and phase["span_id"] == f"{0xABC:016x}"
    assert phase["parent_span_id"] == root["span_id"]
    assert other["trace_id"] != root["trace_id"]
    assert root["attributes"] == {"tenant": "t1", "n": 3}
    assert root["status"] == {"code": 2, "message": "upstream 500"}
    assert root["events"] == [{"name": "first_token", "time_unix_nano": 1_200,
                               "attributes": {"ttft_ms": 12.5}}]
    assert (root["start_time_unix_nano"], root["end_time_unix_nano"]) == (1_000, 2_000)
    assert root["duration_ms"] == 0.001
    assert {d["scope"] for d in lines} == {"sluice.console"}
    assert {d["resource"]["service.name"] for d in lines} == {"svc-console"}
