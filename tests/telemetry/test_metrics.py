"""The metrics registry on prometheus_client: its Prometheus text (parsed back with the
library's parser), the label cardinality bound, the conversion into the SDK's MetricsData and
the OTLP push through the SDK exporters to the test receiver (HTTP and gRPC)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
    OTLPMetricExporter as GrpcMetricExporter,
)
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    MetricExporter,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from prometheus_client.parser import text_string_to_metric_families

from telemetry import Registry, Telemetry, priority_class
from telemetry.bench.otlp_sink import OtlpGrpcReceiver, OtlpReceiver, ReceivedMetric
from telemetry.genai import DURATION_BUCKETS, TOKEN_USAGE_BUCKETS, GenAiClient, GenAiServer
from telemetry.metrics import OTHER, Family
from telemetry.push import MetricsPusher, metrics_data

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> tuple[dict[str, Any], Samples]:
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for f in families.values() for s in f.samples}
    return families, samples


def lb(**labels: str) -> frozenset[tuple[str, str]]:
    return frozenset(labels.items())


def filled() -> Registry:
    r = Registry()
    c = r.counter("sluice_requests_total", "Requests served.", ["tenant", "model"])
    c.inc("a", "m1")
    c.inc("a", "m1", by=2)
    c.inc("b", "m2", by=0.5)
    h = r.histogram("sluice_ttft_seconds", "Time to first token.", ["model"],
                    bounds=(0.1, 0.5, 1.0))
    for v in (0.05, 0.1, 0.3, 0.7, 5.0):  # 0.1 lands in le="0.1": buckets are <=
        h.observe(v, "m1")
    h.child("m2").observe(0.2)
    return r


def test_counter_and_histogram_render_and_parse_back() -> None:
    r = filled()
    families, samples = parse(r.render())
    assert families["sluice_requests"].type == "counter"
    assert families["sluice_requests"].documentation == "Requests served."
    assert samples[("sluice_requests_total", lb(tenant="a", model="m1"))] == 3
    assert samples[("sluice_requests_total", lb(tenant="b", model="m2"))] == 0.5
    assert families["sluice_ttft_seconds"].type == "histogram"
    m1 = {le: samples[("sluice_ttft_seconds_bucket", lb(model="m1", le=le))]
          for le in ("0.1", "0.5", "1.0", "+Inf")}
    assert m1 == {"0.1": 2, "0.5": 3, "1.0": 4, "+Inf": 5}  # cumulative
    assert samples[("sluice_ttft_seconds_count", lb(model="m1"))] == 5
    assert samples[("sluice_ttft_seconds_sum", lb(model="m1"))] == pytest.approx(6.15)
    m2 = [samples[("sluice_ttft_seconds_bucket", lb(model="m2", le=le))]
          for le in ("0.1", "0.5", "1.0", "+Inf")]
    assert m2 == [0, 1, 1, 1]
    assert samples[("sluice_ttft_seconds_sum", lb(model="m2"))] == pytest.approx(0.2)


def test_counter_get_and_unlabelled_metrics() -> None:
    r = Registry()
    c = r.counter("sluice_plain_total", "No labels.")
    c.inc()
    c.inc(by=4)
    labelled = r.counter("sluice_l_total", "L.", ["tenant"])
    labelled.inc("a", by=2)
    assert c.get() == 5 and labelled.get("a") == 2 and labelled.get("never") == 0
    h = r.histogram("sluice_plain_seconds", "No labels.", bounds=(1.0,))
    h.observe(0.5)
    h.observe(3.0)
    _, samples = parse(r.render())
    assert samples[("sluice_plain_total", lb())] == 5
    assert samples[("sluice_plain_seconds_bucket", lb(le="1.0"))] == 1
    assert samples[("sluice_plain_seconds_bucket", lb(le="+Inf"))] == 2
    with pytest.raises(ValueError, match="takes labels"):
        labelled.inc()


def test_label_values_are_escaped_and_parse_back_exactly() -> None:
    r = Registry()
    c = r.counter("sluice_odd_total", "Odd label values.", ["tenant"])
    odd = ['say "hi"', "back\\slash", "line\nbreak", 'all \\" \n\\n mixed', "naïve ✓", ""]
    for i, v in enumerate(odd):
        c.inc(v, by=i + 1)
    h = r.histogram("sluice_odd_seconds", "Odd.", ["tenant"], bounds=(1.0,))
    h.observe(0.5, odd[0])
    _, samples = parse(r.render())
    for i, v in enumerate(odd):
        assert samples[("sluice_odd_total", lb(tenant=v))] == i + 1
    assert samples[("sluice_odd_seconds_count", lb(tenant=odd[0]))] == 1


def test_help_text_is_escaped() -> None:
    r = Registry()
    r.counter("sluice_help_total", "Two\nlines with a back\\slash.").inc()
    families, samples = parse(r.render())
    assert families["sluice_help"].documentation == "Two\nlines with a back\\slash."
    assert samples[("sluice_help_total", lb())] == 1


def test_special_values_render() -> None:
    r = Registry()
    r.collector(lambda: [Family("sluice_ratio", "gauge", "A ratio.").add(float("nan"), k="nan")
                         .add(float("inf"), k="inf").add(-float("inf"), k="-inf")
                         .add(0.125, k="frac").add(1e20, k="big").add(-3, k="neg")])
    _, samples = parse(r.render())
    assert math.isnan(samples[("sluice_ratio", lb(k="nan"))])
    assert samples[("sluice_ratio", lb(k="inf"))] == math.inf
    assert samples[("sluice_ratio", lb(k="-inf"))] == -math.inf
    assert samples[("sluice_ratio", lb(k="frac"))] == 0.125
    assert samples[("sluice_ratio", lb(k="big"))] == 1e20
    assert samples[("sluice_ratio", lb(k="neg"))] == -3


def test_cardinality_is_bounded_and_totals_are_conserved() -> None:
    r = Registry(max_label_values=3)
    c = r.counter("sluice_t_total", "By tenant.", ["tenant"])
    h = r.histogram("sluice_t_seconds", "By tenant.", ["tenant"], bounds=(1.0,))
    for i in range(10):
        c.inc(f"t{i}", by=i + 1)
        h.observe(0.5, f"t{i}")
    c.inc("t1", by=100)  # known values keep their own series
    c.inc("t7", by=1000)  # folded values keep folding
    h.observe(2.0, "t9")
    _, samples = parse(r.render())
    counted = {dict(k[1])["tenant"]: v for k, v in samples.items()
               if k[0] == "sluice_t_total"}
    assert counted == {"t0": 1, "t1": 102, "t2": 3, OTHER: sum(range(4, 11)) + 1000}
    assert sum(counted.values()) == sum(range(1, 11)) + 1100
    hist = {dict(k[1])["tenant"]: v for k, v in samples.items()
            if k[0] == "sluice_t_seconds_count"}
    assert hist == {"t0": 1, "t1": 1, "t2": 1, OTHER: 8}
    assert samples[("sluice_t_seconds_bucket", lb(tenant=OTHER, le="1.0"))] == 7


def series(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def test_cardinality_bound_also_bounds_memory() -> None:
    r = Registry(max_label_values=3)
    c = r.counter("sluice_m_total", "M.", ["tenant", "model"])
    h = r.histogram("sluice_m_seconds", "M.", ["tenant"])
    for i in range(5000):
        c.inc(f"tenant-{i}", "m")
        h.observe(0.01, f"tenant-{i}")
    _, samples = parse(r.render())
    counted = series(samples, "sluice_m_total")
    assert len(counted) == 4 and sum(counted.values()) == 5000
    hist = series(samples, "sluice_m_seconds_count")
    assert len(hist) == 4 and sum(hist.values()) == 5000
    # the per-call caches only hold values within the bound
    assert len(c._children) <= 3 and len(h._children) <= 3


def test_each_label_is_bounded_on_its_own() -> None:
    r = Registry(max_label_values=2)
    c = r.counter("sluice_x_total", "X.", ["tenant", "model"])
    for t in ("a", "b", "c"):
        for m in ("m1", "m2", "m3"):
            c.inc(t, m)
    _, samples = parse(r.render())
    assert series(samples, "sluice_x_total") == {
        lb(tenant=t, model=m): 1 for t in ("a", "b", OTHER) for m in ("m1", "m2", OTHER)}
    assert c.get("a", "m1") == 1 and c.get(OTHER, OTHER) == 1


def test_the_exposition_keeps_its_series_names() -> None:
    """prometheus_client's naming: no _created series, counters named with _total in HELP,
    TYPE and the samples, le as Go formats it, each Registry on its own CollectorRegistry."""
    r = Registry()
    r.counter("sluice_a_total", "A.").inc()
    r.histogram("sluice_b_seconds", "B.", bounds=(0.001, 1.0, 2.5)).observe(0.5)
    r.collector(lambda: [Family("sluice_c_total", "counter", "C.").add(2, k="v")])
    text = r.render()
    assert "_created" not in text
    for line in ("# HELP sluice_a_total A.", "# TYPE sluice_a_total counter",
                 "# TYPE sluice_c_total counter", 'sluice_c_total{k="v"} 2.0',
                 'sluice_b_seconds_bucket{le="0.001"} 0.0', 'sluice_b_seconds_bucket{le="1.0"} 1.0',
                 'sluice_b_seconds_bucket{le="+Inf"} 1.0'):
        assert line in text.splitlines(), line
    other = Registry()  # the same names in another registry: no clash, no shared values
    other.counter("sluice_a_total", "A.")
    assert parse(other.render())[1][("sluice_a_total", lb())] == 0


def test_collectors_are_called_at_every_render() -> None:
    r = Registry()
    depth = {"u1": 3}

    def collect() -> list[Family]:
        fam = Family("sluice_queue_depth", "gauge", "Waiting requests.")
        for upstream, n in depth.items():
            fam.add(n, upstream=upstream)
        return [fam, Family("sluice_engine_steps_total", "counter", "Steps.").add(42)]

    r.collector(collect)
    r.counter("sluice_own_total", "Own.").inc()
    families, samples = parse(r.render())
    assert families["sluice_queue_depth"].type == "gauge"
    assert families["sluice_engine_steps"].type == "counter"
    assert samples[("sluice_queue_depth", lb(upstream="u1"))] == 3
    assert samples[("sluice_engine_steps_total", lb())] == 42
    assert samples[("sluice_own_total", lb())] == 1
    depth.update(u1=0, u2=7)
    _, samples = parse(r.render())
    assert samples[("sluice_queue_depth", lb(upstream="u1"))] == 0
    assert samples[("sluice_queue_depth", lb(upstream="u2"))] == 7


@pytest.mark.parametrize(("priority", "label"), [
    (-5, "p0"), (0, "p0"), (1, "p1-3"), (3, "p1-3"), (4, "p4-6"), (6, "p4-6"), (7, "p7+"),
    (1000, "p7+")])
def test_priority_class(priority: int, label: str) -> None:
    assert priority_class(priority) == label


# ---- OTLP push -----------------------------------------------------------------------------

def test_metrics_data_builds_sdk_metrics() -> None:
    r = filled()
    r.counter("sluice_unused_total", "Never incremented.")
    r.collector(lambda: [Family("sluice_depth", "gauge", "Depth.").add(4, upstream="u1"),
                         Family("sluice_empty", "gauge", "No samples.")])
    md = metrics_data(r.collect(), Resource({"service.name": "svc"}), start_ns=123,
                      scope="sluice.test", version="1.2")
    [rm] = md.resource_metrics
    assert rm.resource.attributes["service.name"] == "svc"
    [sm] = rm.scope_metrics
    assert (sm.scope.name, sm.scope.version) == ("sluice.test", "1.2")
    by_name = {m.name: m for m in sm.metrics}
    # an unlabelled counter is 0 from the start (prometheus_client); an empty family is left out
    assert set(by_name) == {"sluice_requests", "sluice_ttft_seconds", "sluice_depth",
                            "sluice_unused"}
    assert [p.value for p in by_name["sluice_unused"].data.data_points] == [0]

    req = by_name["sluice_requests"]
    assert isinstance(req.data, Sum) and req.data.is_monotonic
    assert req.data.aggregation_temporality is AggregationTemporality.CUMULATIVE
    assert req.description == "Requests served." and req.unit == ""
    assert {(tuple(sorted(p.attributes.items())), p.value) for p in req.data.data_points} == {
        ((("model", "m1"), ("tenant", "a")), 3), ((("model", "m2"), ("tenant", "b")), 0.5)}
    assert {p.start_time_unix_nano for p in req.data.data_points} == {123}
    assert all(p.time_unix_nano > 123 for p in req.data.data_points)

    depth = by_name["sluice_depth"]
    assert isinstance(depth.data, Gauge)
    assert [(dict(p.attributes), p.value) for p in depth.data.data_points] == [
        ({"upstream": "u1"}, 4)]

    ttft = by_name["sluice_ttft_seconds"]
    assert isinstance(ttft.data, Histogram) and ttft.unit == "s"
    assert ttft.data.aggregation_temporality is AggregationTemporality.CUMULATIVE
    points = {p.attributes["model"]: p for p in ttft.data.data_points}
    m1 = points["m1"]
    assert list(m1.explicit_bounds) == [0.1, 0.5, 1.0]
    assert list(m1.bucket_counts) == [2, 1, 1, 1]  # per bucket, the last is +Inf
    assert m1.count == 5 and m1.sum == pytest.approx(6.15)
    assert list(points["m2"].bucket_counts) == [0, 1, 0, 0]

    # through the SDK's OTLP encoder: no made-up min/max on the wire
    proto = encode_metrics(md)
    [hist] = [m for m in proto.resource_metrics[0].scope_metrics[0].metrics
              if m.name == "sluice_ttft_seconds"]
    for p in hist.histogram.data_points:
        assert not p.HasField("min") and not p.HasField("max")


def genai_registry() -> Registry:
    r = Registry()
    server, client = GenAiServer(r), GenAiClient(r)
    server.ended("chat", "m", 0.05, "")
    server.ended("chat", "m", 3.0, "rate_limit_exceeded")
    server.ended("chat", "", 0.001, "invalid_api_key")  # refused before the model was known
    server.answered("chat", "m", 0.02, 0.03)
    client.used("text_completion", "m", 100, 7)
    return r


def test_genai_metrics_go_out_under_their_otel_names() -> None:
    md = metrics_data(genai_registry().collect(), Resource({}), 1, "s", "1")
    by_name = {m.name: m for m in md.resource_metrics[0].scope_metrics[0].metrics}
    assert set(by_name) == {"gen_ai.server.request.duration",
                            "gen_ai.server.time_to_first_token",
                            "gen_ai.server.time_per_output_token", "gen_ai.client.token.usage"}
    duration = by_name["gen_ai.server.request.duration"]
    assert duration.unit == "s" and isinstance(duration.data, Histogram)
    points = {p.attributes.get("error.type"): p for p in duration.data.data_points}
    base = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "sluice"}
    assert dict(points[None].attributes) == {**base, "gen_ai.request.model": "m"}
    assert dict(points["rate_limit_exceeded"].attributes) == {
        **base, "gen_ai.request.model": "m", "error.type": "rate_limit_exceeded"}
    assert dict(points["invalid_api_key"].attributes) == {**base, "error.type": "invalid_api_key"}
    assert list(points[None].explicit_bounds) == list(DURATION_BUCKETS)
    assert sum(points[None].bucket_counts) == 1 and points[None].bucket_counts[3] == 1  # 0.04 < 0.05 ≤ 0.08
    usage = by_name["gen_ai.client.token.usage"]
    assert usage.unit == "{token}" and isinstance(usage.data, Histogram)
    tokens = {p.attributes["gen_ai.token.type"]: p for p in usage.data.data_points}
    assert tokens["input"].sum == 100 and tokens["output"].sum == 7
    assert list(tokens["input"].explicit_bounds) == [float(b) for b in TOKEN_USAGE_BUCKETS]
    assert tokens["input"].attributes["gen_ai.operation.name"] == "text_completion"


def latest(metrics: list[ReceivedMetric], name: str) -> ReceivedMetric | None:
    found = [m for m in metrics if m.name == name]
    return found[-1] if found else None


def http_exporter(rx: OtlpReceiver | OtlpGrpcReceiver) -> MetricExporter:
    return OTLPMetricExporter(endpoint=rx.endpoint + "/v1/metrics", timeout=5)


def grpc_exporter(rx: OtlpReceiver | OtlpGrpcReceiver) -> MetricExporter:
    return GrpcMetricExporter(endpoint=rx.endpoint, insecure=True, timeout=5)


@pytest.mark.parametrize(("receiver", "exporter"), [
    (OtlpReceiver, http_exporter), (OtlpGrpcReceiver, grpc_exporter)], ids=["http", "grpc"])
def test_the_pusher_sends_the_registry_over_otlp(
        receiver: type[OtlpReceiver | OtlpGrpcReceiver],
        exporter: Callable[[OtlpReceiver | OtlpGrpcReceiver], MetricExporter]) -> None:
    r = genai_registry()
    r.counter("sluice_things_total", "Things.", ["kind"]).inc("a", by=5)
    with receiver() as rx:
        pusher = MetricsPusher(r, exporter(rx), 0.05, Resource({"service.name": "svc-push"}),
                               "svc.push", "1.0")
        try:
            def arrived(ms: list[ReceivedMetric]) -> bool:
                return all(latest(ms, n) is not None for n in (
                    "sluice_things", "gen_ai.server.request.duration",
                    "gen_ai.client.token.usage"))

            metrics = rx.wait_for_metrics(arrived, timeout=10)
        finally:
            pusher.shutdown(5)
    assert pusher.exports >= 1 and pusher.failures == 0
    things = latest(metrics, "sluice_things")
    assert things is not None and things.kind == "sum" and things.is_monotonic
    assert things.points == [{"attributes": {"kind": "a"}, "value": 5,
                              "time_ns": things.points[0]["time_ns"]}]
    assert things.resource["service.name"] == "svc-push" and things.scope == "svc.push"
    assert not any(m.name.startswith(("gen_ai_", "sluice_things_total")) for m in metrics)
    duration = latest(metrics, "gen_ai.server.request.duration")
    assert duration is not None and duration.kind == "histogram" and duration.unit == "s"
    ok = next(p for p in duration.points if "error.type" not in p["attributes"])
    assert ok["attributes"] == {"gen_ai.operation.name": "chat",
                                "gen_ai.provider.name": "sluice", "gen_ai.request.model": "m"}
    assert ok["explicit_bounds"] == list(DURATION_BUCKETS) and ok["count"] == 1
    assert {p["attributes"].get("error.type") for p in duration.points} == {
        None, "rate_limit_exceeded", "invalid_api_key"}
    usage = latest(metrics, "gen_ai.client.token.usage")
    assert usage is not None and usage.unit == "{token}"
    assert {p["attributes"]["gen_ai.token.type"]: p["sum"] for p in usage.points} == {
        "input": 100, "output": 7}


def test_telemetry_pushes_the_registry_over_otlp(monkeypatch: pytest.MonkeyPatch) -> None:
    with OtlpReceiver() as rx:
        # in the process's environment: the SDK's exporter reads its own variables
        for name, value in {"OTEL_METRICS_EXPORTER": "otlp",
                            "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
                            "OTEL_METRIC_EXPORT_INTERVAL": "100"}.items():
            monkeypatch.setenv(name, value)
        for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
                     "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
                     "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_SDK_DISABLED"):
            monkeypatch.delenv(name, raising=False)
        tel = Telemetry.create("svc-push")
        try:
            assert tel.pusher is not None and not tel.tracing
            c = tel.registry.counter("sluice_things_total", "Things.", ["kind"])
            c.inc("a", by=5)
            h = tel.registry.histogram("sluice_lat_seconds", "Latency.", bounds=(0.1, 1.0))
            for v in (0.05, 0.5, 2.0):
                h.observe(v)

            def arrived(ms: list[ReceivedMetric]) -> bool:
                things = latest(ms, "sluice_things")
                lat = latest(ms, "sluice_lat_seconds")
                return (things is not None and lat is not None
                        and things.points[0]["value"] == 5 and lat.points[0]["count"] == 3)

            metrics = rx.wait_for_metrics(arrived, timeout=10)
        finally:
            t0 = time.monotonic()
            tel.shutdown()
            assert time.monotonic() - t0 < 3
    assert not any(m.name == "sluice_things_total" for m in metrics)  # _total stripped
    things = latest(metrics, "sluice_things")
    assert things is not None
    assert things.kind == "sum" and things.is_monotonic
    assert things.points[0]["attributes"] == {"kind": "a"}
    assert things.resource["service.name"] == "svc-push"
    assert things.scope == "svc.push"
    lat = latest(metrics, "sluice_lat_seconds")
    assert lat is not None and lat.kind == "histogram" and lat.unit == "s"
    [p] = lat.points
    assert p["bucket_counts"] == [1, 1, 1] and p["explicit_bounds"] == [0.1, 1.0]
    assert p["count"] == 3 and p["sum"] == pytest.approx(2.55)
    assert tel.pusher.exports >= 1 and tel.pusher.failures == 0


def test_render_later_reads_live_state_now_and_formats_anywhere() -> None:
    import threading

    reg = Registry()
    reg.counter("x_total", "x", ("tenant",)).inc("a", by=2)
    reg.histogram("h_seconds", "h", ("tenant",)).observe(0.3, "a")
    state = {"depth": 1.0}
    reg.collector(lambda: [Family("depth", "gauge", "d").add(state["depth"])])
    finish = reg.render_later()
    state["depth"] = 9.0  # read before: the rendering shows the value at the call
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(finish()))
    t.start()
    t.join(10)
    assert out[0] == reg.render().replace("depth 9.0", "depth 1.0")
    assert "depth 1.0" in out[0] and 'x_total{tenant="a"} 2.0' in out[0]


def test_the_otlp_push_reads_live_state_on_the_loop_that_owns_it() -> None:
    """The scrape-time families read loop-owned state: from the pusher's thread they are
    read on the bound loop, the library's instruments on the calling thread."""
    import asyncio
    import threading

    reg = Registry()
    reg.counter("x_total", "x").inc(by=3)
    seen: list[str] = []

    def live() -> list[Family]:
        seen.append(threading.current_thread().name)
        return [Family("depth", "gauge", "d").add(1)]

    reg.collector(live)

    async def main() -> list[str]:
        reg.bind_loop(asyncio.get_running_loop())
        got = await asyncio.to_thread(reg.collect_threadsafe)
        return [m.name for m in got]

    names = asyncio.run(main())
    assert names == ["depth", "x"]  # as collect() orders them: families first
    assert seen == [threading.main_thread().name]  # read on the loop's thread
    # the loop is gone: read directly, on the caller's thread
    got = [m.name for m in reg.collect_threadsafe()]
    assert got == ["depth", "x"] and len(seen) == 2
