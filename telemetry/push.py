"""OTLP metrics push: the registry's families, every interval, through the SDK's exporters.

The registry is the source of truth (cheap on the hot path); this thread turns a snapshot
into the SDK's ``MetricsData`` (cumulative temporality, like Prometheus) and hands it to
``OTLPMetricExporter`` (HTTP or gRPC). Export failures are logged by the exporter and
counted here; they never reach a request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from .config import ExportTarget
from .metrics import Family, Registry

log = logging.getLogger("sluice.telemetry")


def metrics_data(families: list[Family], resource: Mapping[str, Any], start_ns: int,
                 scope: str, version: str) -> Any:
    from opentelemetry.sdk.metrics.export import (
        AggregationTemporality,
        Gauge,
        Histogram,
        HistogramDataPoint,
        Metric,
        MetricsData,
        NumberDataPoint,
        ResourceMetrics,
        ScopeMetrics,
        Sum,
    )
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    now = time.time_ns()
    cumulative = AggregationTemporality.CUMULATIVE
    metrics = []
    for fam in families:
        data: Any
        if fam.kind == "histogram":
            if not fam.points:
                continue
            data = Histogram([HistogramDataPoint(
                attributes=dict(lb), start_time_unix_nano=start_ns, time_unix_nano=now,
                count=p.count, sum=p.sum, bucket_counts=list(p.counts),
                explicit_bounds=list(p.bounds),
                min=None, max=None)  # type: ignore[arg-type]  # unknown: None is not sent
                for lb, p in fam.points], cumulative)
        else:
            if not fam.samples:
                continue
            points = [NumberDataPoint(attributes=dict(lb), start_time_unix_nano=start_ns,
                                      time_unix_nano=now, value=v) for lb, v in fam.samples]
            data = Sum(points, cumulative, True) if fam.kind == "counter" else Gauge(points)
        # OTLP names carry no _total suffix; Prometheus-side exporters add it back.
        name = fam.name.removesuffix("_total") if fam.kind == "counter" else fam.name
        metrics.append(Metric(name, fam.help, fam.unit, data))
    return MetricsData([ResourceMetrics(
        Resource(dict(resource)),
        [ScopeMetrics(InstrumentationScope(scope, version), metrics, "")], "")])


def _exporter(target: ExportTarget, headers: Mapping[str, str], timeout_s: float) -> Any:
    if target.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=target.url, insecure=target.url.startswith("http://"),
                            headers=dict(headers) or None, timeout=timeout_s)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    return OTLPMetricExporter(endpoint=target.url, headers=dict(headers) or None,
                              timeout=timeout_s)


class MetricsPusher:
    def __init__(self, registry: Registry, target: ExportTarget, resource: Mapping[str, Any],
                 headers: Mapping[str, str], timeout_s: float, interval_s: float,
                 scope: str, version: str) -> None:
        self.registry = registry
        self.resource = dict(resource)
        self.interval_s = interval_s
        self.scope, self.version = scope, version
        self.exporter = _exporter(target, headers, timeout_s)
        self.exports = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sluice-metrics-push",
                                        daemon=True)
        self._thread.start()

    def push(self) -> bool:
        from opentelemetry.sdk.metrics.export import MetricExportResult

        try:
            data = metrics_data(self.registry.collect(), self.resource, self.registry.start_ns,
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
            self.exporter.shutdown()
        except Exception:
            log.debug("closing the metrics exporter failed", exc_info=True)
