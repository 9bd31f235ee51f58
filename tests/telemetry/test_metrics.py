"""The metrics registry: Prometheus text (parsed back with prometheus_client), the label
cardinality bound, and the OTLP push through the SDK exporters to the test receiver."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.sdk.metrics.export import AggregationTemporality, Gauge, Histogram, Sum
from prometheus_client.parser import text_string_to_metric_families

from telemetry import Registry, Telemetry, priority_class, record_phase
from telemetry.bench.otlp_sink import OtlpReceiver, ReceivedMetric
from telemetry.metrics import OTHER, Family
from telemetry.push import metrics_data

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


def test_cardinality_bound_also_bounds_memory() -> None:
    r = Registry(max_label_values=3)
    c = r.counter("sluice_m_total", "M.", ["tenant", "model"])
    h = r.histogram("sluice_m_seconds", "M.", ["tenant"])
    for i in range(5000):
        c.inc(f"tenant-{i}", "m")
        h.observe(0.01, f"tenant-{i}")
    assert len(c.values) == 4 and len(h.points) == 4
    # the per-call caches only hold values within the bound
    assert len(c._alias) <= 3 and len(h._alias) <= 3
    assert sum(c.values.values()) == 5000
    assert sum(p.count for p in h.points.values()) == 5000


def test_each_label_is_bounded_on_its_own() -> None:
    r = Registry(max_label_values=2)
    c = r.counter("sluice_x_total", "X.", ["tenant", "model"])
    for t in ("a", "b", "c"):
        for m in ("m1", "m2", "m3"):
            c.inc(t, m)
    assert c.values == {("a", "m1"): 1, ("a", "m2"): 1, ("a", OTHER): 1,
                        ("b", "m1"): 1, ("b", "m2"): 1, ("b", OTHER): 1,
                        (OTHER, "m1"): 1, (OTHER, "m2"): 1, (OTHER, OTHER): 1}


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
    md = metrics_data(r.collect(), {"service.name": "svc"}, start_ns=123, scope="sluice.test",
                      version="1.2")
    [rm] = md.resource_metrics
    assert rm.resource.attributes["service.name"] == "svc"
    [sm] = rm.scope_metrics
    assert (sm.scope.name, sm.scope.version) == ("sluice.test", "1.2")
    by_name = {m.name: m for m in sm.metrics}
    assert set(by_name) == {"sluice_requests", "sluice_ttft_seconds", "sluice_depth"}

    req = by_name["sluice_requests"]
    assert isinstance(req.data, Sum) and req.data.is_monotonic
    assert req.data.aggregation_temporality is AggregationTemporality.CUMULATIVE
    assert req.description == "Requests served."
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


def latest(metrics: list[ReceivedMetric], name: str) -> ReceivedMetric | None:
    found = [m for m in metrics if m.name == name]
    return found[-1] if found else None


def test_telemetry_pushes_the_registry_over_otlp() -> None:
    with OtlpReceiver() as rx:
        tel = Telemetry.create("svc-push", env={
            "OTEL_METRICS_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
            "OTEL_METRIC_EXPORT_INTERVAL": "100"})
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


def test_telemetry_exports_spans_and_counts_them() -> None:
    with OtlpReceiver() as rx:
        tel = Telemetry.create("svc-traces", env={
            "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "50"})
        try:
            assert tel.tracing
            with tel.tracer.start_as_current_span("op", attributes={"k": "v"}) as span:
                now = time.time_ns()
                record_phase(tel.tracer, span, "phase", now, now + 1_000)
            assert tel.force_flush(5)
            got = {s.name: s for s in rx.wait_for(lambda s: len(s) >= 2, 5)}
            _, samples = parse(tel.registry.render())
        finally:
            tel.shutdown()
    assert set(got) == {"op", "phase"}
    op = got["op"]
    assert op.attributes == {"k": "v"} and op.scope == "svc.traces"
    assert op.resource["service.name"] == "svc-traces"
    assert op.resource["service.version"] == tel.version
    assert op.resource["telemetry.sdk.name"] == "sluice"
    assert got["phase"].parent_span_id == op.span_id
    assert samples[("sluice_telemetry_spans_total", lb(result="exported"))] == 2
    assert samples[("sluice_telemetry_spans_total", lb(result="dropped_queue_full"))] == 0
    assert samples[("sluice_telemetry_spans_total", lb(result="export_failed"))] == 0
