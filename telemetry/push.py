"""OTLP metrics push: the registry's families, every interval, through an SDK exporter.

The registry (``prometheus_client``) is the source of truth, cheap on the hot path; this
thread turns a snapshot of its families into the SDK's ``MetricsData`` (cumulative
temporality, like Prometheus) and hands it to a ``MetricExporter`` (OTLP/HTTP or OTLP/gRPC,
built by ``telemetry.setup``). Counters become monotonic sums named without ``_total``;
histograms carry per-bucket (not cumulative) counts; the GenAI metrics go under their OTel
names, units and attribute names (``telemetry.genai.OTEL``). Export failures are logged by
the exporter and counted here; they never reach a request.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable, Mapping

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client.metrics_core import Metric as PromMetric

from .genai import OTEL, OtelName
from .metrics import Registry

log = logging.getLogger("sluice.telemetry")

_CUMULATIVE = AggregationTemporality.CUMULATIVE


def _attributes(labels: Mapping[str, str], otel: OtelName | None) -> dict[str, str]:
    if otel is None:
        return dict(labels)
    # an empty value is an absent attribute (error_type on a success)
    return {otel.attributes.get(k, k): v for k, v in labels.items() if v != ""}


class _Series:
    """One label set of a histogram, gathered from its samples."""

    __slots__ = ("buckets", "count", "labels", "sum")

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.buckets: list[tuple[float, float]] = []  # (le, cumulative count)
        self.sum = 0.0
        self.count = 0

    def point(self, otel: OtelName | None, start_ns: int, now: int) -> HistogramDataPoint:
        """Prometheus's cumulative buckets back into per-bucket counts, the last +Inf."""
        bounds, counts, below = [], [], 0.0
        for le, cumulative in sorted(self.buckets):
            if not math.isinf(le):
                bounds.append(le)
            counts.append(int(cumulative - below))
            below = cumulative
        return HistogramDataPoint(
            attributes=_attributes(self.labels, otel), start_time_unix_nano=start_ns,
            time_unix_nano=now, count=self.count, sum=self.sum, bucket_counts=counts,
            explicit_bounds=bounds,
            min=None, max=None)  # type: ignore[arg-type]  # unknown: None is not sent


def _histogram(fam: PromMetric, otel: OtelName | None, start_ns: int,
               now: int) -> Histogram | None:
    series: dict[tuple[tuple[str, str], ...], _Series] = {}
    for s in fam.samples:
        labels = {k: v for k, v in s.labels.items() if k != "le"}
        key = tuple(sorted(labels.items()))
        one = series.get(key)
        if one is None:
            one = series[key] = _Series(labels)
        if s.name.endswith("_bucket"):
            one.buckets.append((float(s.labels["le"]), s.value))
        elif s.name.endswith("_sum"):
            one.sum = s.value
        elif s.name.endswith("_count"):
            one.count = int(s.value)
    if not series:
        return None
    return Histogram([one.point(otel, start_ns, now) for one in series.values()], _CUMULATIVE)


def _number(fam: PromMetric, otel: OtelName | None, start_ns: int,
            now: int) -> Sum | Gauge | None:
    points = [NumberDataPoint(attributes=_attributes(s.labels, otel),
                              start_time_unix_nano=start_ns, time_unix_nano=now, value=s.value)
              for s in fam.samples if not s.name.endswith("_created")]
    if not points:
        return None
    return Sum(points, _CUMULATIVE, True) if fam.type == "counter" else Gauge(points)


def metrics_data(families: Iterable[PromMetric], resource: Resource, start_ns: int,
                 scope: str, version: str) -> MetricsData:
    """The SDK's ``MetricsData`` of ``prometheus_client`` families (``Registry.collect()``):
    a family without samples, or of a type other than counter, gauge and histogram, is
    left out."""
    now = time.time_ns()
    metrics = []
    for fam in families:
        otel = OTEL.get(fam.name)
        data: Histogram | Sum | Gauge | None
        if fam.type == "histogram":
            data = _histogram(fam, otel, start_ns, now)
        elif fam.type in ("counter", "gauge"):
            data = _number(fam, otel, start_ns, now)
        else:
            data = None
        if data is None:
            continue
        if otel is not None:
            name, unit = otel.name, otel.unit
        else:  # the library names a counter's family without _total, as OTLP names go
            name = fam.name
            unit = "s" if fam.type == "histogram" and name.endswith("_seconds") else ""
        metrics.append(Metric(name, fam.documentation, unit, data))
    return MetricsData([ResourceMetrics(
        resource, [ScopeMetrics(InstrumentationScope(scope, version), metrics, "")], "")])


class MetricsPusher:
    """Pushes ``registry`` through ``exporter`` every ``interval_s`` from its own thread."""

    def __init__(self, registry: Registry, exporter: MetricExporter, interval_s: float,
                 resource: Resource, scope: str, version: str) -> None:
        self.registry = registry
        self.exporter = exporter
        self.interval_s = interval_s
        self.resource = resource
        self.scope, self.version = scope, version
        self.exports = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sluice-metrics-push",
                                        daemon=True)
        self._thread.start()

    def push(self) -> bool:
        try:
            data = metrics_data(self.registry.collect_threadsafe(), self.resource,
                                self.registry.start_ns,
                                self.scope, self.version)
            ok = self.exporter.export(data) is MetricExportResult.SUCCESS
        except Exception:
            log.warning("metrics export failed", exc_info=True)
            ok = False
        self.exports += 1
        self.failures += 0 if ok else 1
        return ok

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.push()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        self.push()  # the last values, so a short-lived process still reports
        try:
            self.exporter.shutdown(timeout_millis=timeout_s * 1000)
        except Exception:
            log.debug("closing the metrics exporter failed", exc_info=True)
