"""The test-only OTLP receiver: what it decodes must match what was sent, field by field."""

from __future__ import annotations

import gzip
import http.client
import os
import signal
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as msvc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as msvc_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tsvc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tsvc_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from telemetry.bench.otlp_sink import (
    OtlpGrpcReceiver,
    OtlpReceiver,
    ReceivedEvent,
    ReceivedMetric,
    ReceivedSpan,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
ROOT_ID = "b7ad6b7169203331"
CHILD_ID = "00f067aa0ba902b7"
RESOURCE = {"service.name": "sluice-gateway", "service.instance.id": "gw-1"}
PROTOBUF = {"content-type": "application/x-protobuf"}


def kv(key: str, **value: object) -> common_pb2.KeyValue:
    return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(**value))


def resource() -> resource_pb2.Resource:
    return resource_pb2.Resource(attributes=[kv(k, string_value=v) for k, v in RESOURCE.items()])


def trace_request() -> tsvc.ExportTraceServiceRequest:
    root = trace_pb2.Span(
        trace_id=bytes.fromhex(TRACE_ID), span_id=bytes.fromhex(ROOT_ID),
        name="POST /v1/chat/completions", kind=trace_pb2.Span.SPAN_KIND_SERVER,
        start_time_unix_nano=1_000, end_time_unix_nano=9_000, flags=0x101,
        attributes=[
            kv("tenant", string_value="acme"),
            kv("http.status_code", int_value=200),
            kv("cache.hit", bool_value=False),
            kv("queue.ratio", double_value=0.25),
            kv("models", array_value=common_pb2.ArrayValue(values=[
                common_pb2.AnyValue(string_value="tiny"), common_pb2.AnyValue(int_value=2)])),
            kv("limits", kvlist_value=common_pb2.KeyValueList(values=[
                kv("rpm", int_value=60), kv("burst", bool_value=True)])),
            kv("digest", bytes_value=b"\x00\xff"),
        ],
        status=trace_pb2.Status(code=trace_pb2.Status.STATUS_CODE_OK))
    child = trace_pb2.Span(
        trace_id=bytes.fromhex(TRACE_ID), span_id=bytes.fromhex(CHILD_ID),
        parent_span_id=bytes.fromhex(ROOT_ID), name="backend.generate",
        kind=trace_pb2.Span.SPAN_KIND_CLIENT, start_time_unix_nano=2_000,
        end_time_unix_nano=8_000, attributes=[kv("tokens", int_value=7)],
        events=[trace_pb2.Span.Event(name="first_token", time_unix_nano=3_000,
                                     attributes=[kv("ttft_ms", double_value=1.5)])],
        status=trace_pb2.Status(code=trace_pb2.Status.STATUS_CODE_ERROR, message="upstream 502"))
    return tsvc.ExportTraceServiceRequest(resource_spans=[trace_pb2.ResourceSpans(
        resource=resource(), scope_spans=[trace_pb2.ScopeSpans(
            scope=common_pb2.InstrumentationScope(name="sluice.gateway", version="0.1.0"),
            spans=[root, child])])])


EXPECTED_SPANS = [
    ReceivedSpan(
        trace_id=TRACE_ID, span_id=ROOT_ID, parent_span_id=None,
        name="POST /v1/chat/completions", kind=2, start_ns=1_000, end_ns=9_000,
        attributes={"tenant": "acme", "http.status_code": 200, "cache.hit": False,
                    "queue.ratio": 0.25, "models": ["tiny", 2],
                    "limits": {"rpm": 60, "burst": True}, "digest": b"\x00\xff"},
        events=[], status_code=1, status_message="", resource=RESOURCE, scope="sluice.gateway",
        flags=0x101),
    ReceivedSpan(
        trace_id=TRACE_ID, span_id=CHILD_ID, parent_span_id=ROOT_ID, name="backend.generate",
        kind=3, start_ns=2_000, end_ns=8_000, attributes={"tokens": 7},
        events=[ReceivedEvent("first_token", 3_000, {"ttft_ms": 1.5})], status_code=2,
        status_message="upstream 502", resource=RESOURCE, scope="sluice.gateway"),
]


def metrics_request() -> msvc.ExportMetricsServiceRequest:
    requests = metrics_pb2.Metric(name="sluice.requests", unit="1", sum=metrics_pb2.Sum(
        is_monotonic=True,
        aggregation_temporality=metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE,
        data_points=[
            metrics_pb2.NumberDataPoint(time_unix_nano=5, as_int=12,
                                        attributes=[kv("tenant", string_value="acme")]),
            metrics_pb2.NumberDataPoint(time_unix_nano=5, as_int=3,
                                        attributes=[kv("tenant", string_value="beta")])]))
    latency = metrics_pb2.Metric(name="sluice.latency", unit="ms", histogram=metrics_pb2.Histogram(
        aggregation_temporality=metrics_pb2.AGGREGATION_TEMPORALITY_DELTA,
        data_points=[metrics_pb2.HistogramDataPoint(
            time_unix_nano=6, count=4, sum=42.5, bucket_counts=[1, 2, 1],
            explicit_bounds=[5.0, 50.0], attributes=[kv("route", string_value="chat")])]))
    queue = metrics_pb2.Metric(name="sluice.queue_depth", gauge=metrics_pb2.Gauge(
        data_points=[metrics_pb2.NumberDataPoint(time_unix_nano=7, as_double=0.5)]))
    return msvc.ExportMetricsServiceRequest(resource_metrics=[metrics_pb2.ResourceMetrics(
        resource=resource(), scope_metrics=[metrics_pb2.ScopeMetrics(
            scope=common_pb2.InstrumentationScope(name="sluice.gateway"),
            metrics=[requests, latency, queue])])])


EXPECTED_METRICS = [
    ReceivedMetric(name="sluice.requests", kind="sum", resource=RESOURCE, scope="sluice.gateway",
                   unit="1", is_monotonic=True, points=[
                       {"attributes": {"tenant": "acme"}, "time_ns": 5, "value": 12},
                       {"attributes": {"tenant": "beta"}, "time_ns": 5, "value": 3}]),
    ReceivedMetric(name="sluice.latency", kind="histogram", resource=RESOURCE,
                   scope="sluice.gateway", unit="ms", points=[
                       {"attributes": {"route": "chat"}, "time_ns": 6, "count": 4, "sum": 42.5,
                        "bucket_counts": [1, 2, 1], "explicit_bounds": [5.0, 50.0]}]),
    ReceivedMetric(name="sluice.queue_depth", kind="gauge", resource=RESOURCE,
                   scope="sluice.gateway", points=[{"attributes": {}, "time_ns": 7, "value": 0.5}]),
]


@pytest.fixture
def rx() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=5) as c:
        yield c


@pytest.mark.parametrize("encoding", [None, "gzip", "deflate"])
def test_http_trace_round_trip(rx: OtlpReceiver, client: httpx.Client,
                               encoding: str | None) -> None:
    body = trace_request().SerializeToString()
    sent = {"gzip": gzip.compress, "deflate": zlib.compress, None: bytes}[encoding](body)
    headers = PROTOBUF | ({"content-encoding": encoding} if encoding else {})
    resp = client.post(f"{rx.endpoint}/v1/traces", content=sent, headers=headers)
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "application/x-protobuf"
    assert tsvc.ExportTraceServiceResponse.FromString(resp.content) == \
        tsvc.ExportTraceServiceResponse()
    assert rx.spans() == EXPECTED_SPANS
    assert (rx.requests, rx.bytes_received) == (1, len(sent))
    assert rx.endpoint.startswith("http://127.0.0.1:") and rx.endpoint.count("/") == 2


def test_http_metrics_round_trip(rx: OtlpReceiver, client: httpx.Client) -> None:
    resp = client.post(f"{rx.endpoint}/v1/metrics", headers=PROTOBUF,
                       content=metrics_request().SerializeToString())
    assert resp.status_code == 200
    assert msvc.ExportMetricsServiceResponse.FromString(resp.content) == \
        msvc.ExportMetricsServiceResponse()
    assert rx.metrics() == EXPECTED_METRICS
    assert rx.spans() == []


def test_unknown_paths_are_404_and_keep_the_connection_usable(rx: OtlpReceiver) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", int(rx.endpoint.rsplit(":", 1)[1]), timeout=5)
    body = trace_request().SerializeToString()
    answers = []
    for method, path in [("POST", "/v1/logs"), ("GET", "/v1/traces"), ("POST", "/v1/traces"),
                         ("POST", "/"), ("POST", "/v1/traces")]:
        conn.request(method, path, body=body, headers=PROTOBUF)
        resp = conn.getresponse()
        resp.read()
        answers.append(resp.status)
        if len(answers) == 1:
            sock = conn.sock
        assert conn.sock is sock  # same connection each time: keep-alive held
    assert answers == [404, 404, 200, 404, 200]
    assert rx.requests == 2
    assert len(rx.spans()) == 4
    conn.close()


def test_pipelined_requests_and_connection_close(rx: OtlpReceiver) -> None:
    body = trace_request().SerializeToString()
    head = f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
    with socket.create_connection(("127.0.0.1", int(rx.endpoint.rsplit(":", 1)[1]))) as s:
        s.settimeout(5)
        s.sendall((head + "\r\n").encode() + body + (head + "Connection: close\r\n\r\n").encode()
                  + body)
        data = b""
        while chunk := s.recv(65536):  # the server closes after the second answer
            data += chunk
    assert data.count(b"HTTP/1.1 200 OK\r\n") == 2
    assert data.endswith(b"Connection: close\r\n\r\n")
    assert len(rx.spans()) == 4


def test_malformed_body_is_400(rx: OtlpReceiver, client: httpx.Client) -> None:
    resp = client.post(f"{rx.endpoint}/v1/traces", content=b"\xff\xff\xff", headers=PROTOBUF)
    assert resp.status_code == 400
    resp = client.post(f"{rx.endpoint}/v1/traces", content=b"not gzip",
                       headers=PROTOBUF | {"content-encoding": "gzip"})
    assert resp.status_code == 400
    assert rx.spans() == []


def test_no_decode_only_counts(client: httpx.Client) -> None:
    body = trace_request().SerializeToString()
    with OtlpReceiver(decode=False) as sink:
        for _ in range(3):
            assert client.post(f"{sink.endpoint}/v1/traces", content=body,
                               headers=PROTOBUF).status_code == 200
        assert client.post(f"{sink.endpoint}/v1/metrics", content=b"junk",
                           headers=PROTOBUF).status_code == 200
        assert (sink.requests, sink.bytes_received) == (4, 3 * len(body) + 4)
        assert sink.spans() == [] and sink.metrics() == []


def test_failure_status(rx: OtlpReceiver, client: httpx.Client) -> None:
    body = trace_request().SerializeToString()
    rx.status = 503
    assert client.post(f"{rx.endpoint}/v1/traces", content=body,
                       headers=PROTOBUF).status_code == 503
    assert rx.spans() == [] and rx.requests == 1
    rx.status = 200
    assert client.post(f"{rx.endpoint}/v1/traces", content=body,
                       headers=PROTOBUF).status_code == 200
    assert rx.spans() == EXPECTED_SPANS


def test_clear_and_wait_for(rx: OtlpReceiver, client: httpx.Client) -> None:
    client.post(f"{rx.endpoint}/v1/traces", content=trace_request().SerializeToString(),
                headers=PROTOBUF)
    assert [s.name for s in rx.wait_for(lambda spans: len(spans) == 2)] == \
        ["POST /v1/chat/completions", "backend.generate"]
    with pytest.raises(TimeoutError, match="backend.generate"):
        rx.wait_for(lambda spans: any(s.name == "missing" for s in spans), timeout=0.2)
    with pytest.raises(TimeoutError, match="no matching metrics"):
        rx.wait_for_metrics(lambda metrics: bool(metrics), timeout=0.1)
    rx.clear()
    assert (rx.spans(), rx.metrics(), rx.requests, rx.bytes_received) == ([], [], 0, 0)


async def test_usable_from_an_async_test(rx: OtlpReceiver) -> None:
    async with httpx.AsyncClient(timeout=5) as aclient:
        resp = await aclient.post(f"{rx.endpoint}/v1/traces", headers=PROTOBUF,
                                  content=trace_request().SerializeToString())
    assert resp.status_code == 200
    assert rx.spans() == EXPECTED_SPANS


def test_stop_closes_idle_keepalive_connections(client: httpx.Client) -> None:
    receiver = OtlpReceiver().__enter__()
    url = f"{receiver.endpoint}/v1/traces"
    assert client.post(url, content=b"", headers=PROTOBUF).status_code == 200
    started = time.monotonic()
    receiver.stop()  # with an idle keep-alive connection open
    assert time.monotonic() - started < 3
    with pytest.raises(httpx.TransportError):
        client.post(url, content=b"", headers=PROTOBUF)


def test_grpc_round_trip() -> None:
    with OtlpGrpcReceiver() as grx:
        assert grx.endpoint.startswith("http://127.0.0.1:")
        with grpc.insecure_channel(grx.endpoint.removeprefix("http://")) as channel:
            traces = tsvc_grpc.TraceServiceStub(channel)
            assert traces.Export(trace_request(), timeout=5) == tsvc.ExportTraceServiceResponse()
            metrics = msvc_grpc.MetricsServiceStub(channel)
            assert metrics.Export(metrics_request(), timeout=5) == \
                msvc.ExportMetricsServiceResponse()
            assert grx.spans() == EXPECTED_SPANS
            assert grx.metrics() == EXPECTED_METRICS
            assert grx.requests == 2
            grx.status = 503
            with pytest.raises(grpc.RpcError) as err:
                traces.Export(trace_request(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert len(grx.spans()) == 2 and grx.requests == 3


@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_sdk_http_exporter(rx: OtlpReceiver, compression: str) -> None:
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    exporter = OTLPSpanExporter(endpoint=f"{rx.endpoint}/v1/traces",
                                compression=Compression(compression), timeout=5)
    _export_with_sdk(exporter)
    _check_sdk_spans(rx)


def test_sdk_grpc_exporter() -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    with OtlpGrpcReceiver() as grx:
        _export_with_sdk(OTLPSpanExporter(endpoint=grx.endpoint, insecure=True, timeout=5))
        _check_sdk_spans(grx)


def test_sdk_http_metric_exporter(rx: OtlpReceiver) -> None:
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource

    reader = PeriodicExportingMetricReader(
        OTLPMetricExporter(endpoint=f"{rx.endpoint}/v1/metrics", timeout=5),
        export_interval_millis=60_000)
    provider = MeterProvider(metric_readers=[reader],
                             resource=Resource.create({"service.name": "sdk-test"}))
    meter = provider.get_meter("sluice.test")
    meter.create_counter("sluice.requests").add(3, {"tenant": "acme"})
    meter.create_histogram("sluice.latency", unit="ms").record(12.0)
    provider.shutdown()  # final collect + export
    by_name = {m.name: m for m in rx.wait_for_metrics(lambda ms: len(ms) >= 2, timeout=5)}
    counter, hist = by_name["sluice.requests"], by_name["sluice.latency"]
    assert (counter.kind, counter.is_monotonic, counter.scope) == ("sum", True, "sluice.test")
    assert [(p["attributes"], p["value"]) for p in counter.points] == [({"tenant": "acme"}, 3)]
    assert counter.resource["service.name"] == "sdk-test"
    assert (hist.kind, hist.unit, hist.points[0]["count"], hist.points[0]["sum"]) == \
        ("histogram", "ms", 1, 12.0)
    assert sum(hist.points[0]["bucket_counts"]) == 1


def _export_with_sdk(exporter: object) -> None:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.trace import SpanKind

    provider = TracerProvider(resource=Resource.create({"service.name": "sdk-test"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))  # type: ignore[arg-type]
    tracer = provider.get_tracer("sluice.test")
    with (tracer.start_as_current_span("outer", kind=SpanKind.SERVER),
          tracer.start_as_current_span("inner") as span):
        span.set_attribute("tokens", 7)
        span.set_attribute("tenant", "acme")
        span.add_event("first_token", {"i": 1})
    provider.shutdown()


def _check_sdk_spans(receiver: OtlpReceiver | OtlpGrpcReceiver) -> None:
    spans = {s.name: s for s in receiver.wait_for(lambda s: len(s) >= 2, timeout=5)}
    outer, inner = spans["outer"], spans["inner"]
    assert inner.parent_span_id == outer.span_id and outer.parent_span_id is None
    assert inner.trace_id == outer.trace_id and len(inner.trace_id) == 32
    assert len(inner.span_id) == 16
    assert (outer.kind, inner.kind) == (2, 1)  # SERVER, INTERNAL
    assert inner.attributes == {"tokens": 7, "tenant": "acme"}
    assert [(e.name, e.attributes) for e in inner.events] == [("first_token", {"i": 1})]
    assert inner.resource["service.name"] == "sdk-test"
    assert inner.scope == "sluice.test"
    assert outer.start_ns <= inner.start_ns <= inner.end_ns <= outer.end_ns


def test_main_prints_a_line_per_export(client: httpx.Client) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "telemetry.bench.otlp_sink",
                             "--port", str(port)],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None
        assert f"http://127.0.0.1:{port}" in proc.stdout.readline()
        resp = client.post(f"http://127.0.0.1:{port}/v1/traces", headers=PROTOBUF,
                           content=trace_request().SerializeToString())
        assert resp.status_code == 200
        assert proc.stdout.readline().rstrip().endswith("traces: 2 spans")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert "stopped: 1 requests" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
