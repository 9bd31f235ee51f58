"""``Telemetry``: the one object a process builds to trace and measure itself.

The gateway and the backend each build one in their lifespan from their YAML section (or
none) plus the environment, take ``.tracer`` (an ``opentelemetry.trace.Tracer``) and
``.registry`` (``telemetry.metrics.Registry``) from it, and call ``shutdown()`` on the way
out, which flushes queued spans and pushes the last metrics.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import platform
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .config import Settings, TelemetryConfig, resolve
from .export import BatchExporter, Console, OtlpGrpc, OtlpHttp, Transport
from .metrics import Family, Registry
from .push import MetricsPusher
from .shipper import ShipperTransport
from .tracing import Sampler, TracerProvider

log = logging.getLogger("sluice.telemetry")

_W3C = TraceContextTextMapPropagator()


def sluice_version() -> str:
    try:
        return importlib.metadata.version("sluice")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


class Telemetry:
    def __init__(self, settings: Settings, scope: str, version: str | None = None) -> None:
        self.settings = settings
        self.version = version or sluice_version()
        self.resource: dict[str, Any] = {
            **settings.resource_attributes,
            "service.name": settings.service_name,
            "service.version": self.version,
            "service.instance.id": uuid.uuid4().hex,
            "host.name": platform.node(),
            "process.pid": os.getpid(),
            "telemetry.sdk.name": "sluice",
            "telemetry.sdk.language": "python",
            "telemetry.sdk.version": self.version,
        }
        self.registry = Registry(settings.max_label_values)
        self.spans: BatchExporter | None = None
        self.tracer: trace.Tracer = trace.NoOpTracer()
        if settings.tracing:
            self.spans = BatchExporter(self._transport(), settings.max_queue_size,
                                       settings.max_batch_size, settings.schedule_delay_s)
            provider = TracerProvider(Sampler(settings.sampler, settings.sampler_arg),
                                      self.spans)
            self.tracer = provider.get_tracer(scope, self.version)
        self.pusher: MetricsPusher | None = None
        if settings.metrics.exporter == "otlp":
            self.pusher = MetricsPusher(self.registry, settings.metrics, self.resource,
                                        settings.headers, settings.timeout_s,
                                        settings.metrics_interval_s, scope, self.version)
        self.registry.collector(self._self_metrics)

    @classmethod
    def create(cls, service: str, config: TelemetryConfig | None = None,
               env: Mapping[str, str] | None = None, scope: str | None = None) -> Telemetry:
        """Resolve the settings (raises ``TelemetryError`` on bad ones) and build."""
        settings = resolve(config, service, os.environ if env is None else env)
        tel = cls(settings, scope or service.replace("-", "."))
        log.info("telemetry: %s", describe(settings))
        return tel

    @property
    def tracing(self) -> bool:
        """False when spans go nowhere: callers skip building attributes at all."""
        return self.spans is not None

    def _transport(self) -> Transport:
        s = self.settings
        if s.traces.exporter == "console":
            return Console(self.resource)
        if s.export_process:
            return ShipperTransport({
                "protocol": s.traces.protocol, "url": s.traces.url, "resource": self.resource,
                "headers": s.headers, "timeout_s": s.timeout_s,
                "max_batch": s.max_batch_size, "delay_s": s.schedule_delay_s})
        if s.traces.protocol == "grpc":
            return OtlpGrpc(s.traces.url, self.resource, s.headers, s.timeout_s)
        return OtlpHttp(s.traces.url, self.resource, s.headers, s.timeout_s)

    def _self_metrics(self) -> Iterable[Family]:
        fam = Family("sluice_telemetry_spans_total", "counter",
                     "Spans handed to the exporter, by fate.")
        if self.spans is not None:
            fam.add(self.spans.exported, result="exported")
            fam.add(self.spans.dropped, result="dropped_queue_full")
            fam.add(self.spans.failed, result="export_failed")
        yield fam
        if self.pusher is not None:
            yield Family("sluice_telemetry_metric_export_failures_total", "counter",
                         "OTLP metric exports that failed.").add(self.pusher.failures)

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        return self.spans.force_flush(timeout_s) if self.spans is not None else True

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self.spans is not None:
            self.spans.force_flush(timeout_s)
            self.spans.shutdown(timeout_s)
        if self.pusher is not None:
            self.pusher.shutdown(timeout_s)


def describe(s: Settings) -> str:
    """Where spans and pushed metrics go, for the start-up log: only destinations really
    used (an OTLP URL resolves whatever the exporter, so console must not name it)."""
    if s.tracing and s.traces.exporter == "console":
        traces = f"traces to stdout (console, sampler {s.sampler})"
    elif s.tracing:
        traces = f"traces to {s.traces.url} (OTLP {s.traces.protocol}, sampler {s.sampler})"
    else:
        traces = "traces off" + (f" (sampler {s.sampler})" if s.traces.exporter != "none"
                                 else "")
    m = s.metrics
    metrics = (f"OTLP metrics to {m.url} ({m.protocol}, every {s.metrics_interval_s:g} s)"
               if m.exporter == "otlp" else "OTLP metrics off")
    return f"service {s.service_name}, {traces}, {metrics}"


def extract(traceparent: str | None, tracestate: str | None = None) -> Context | None:
    """The remote parent from W3C ``traceparent``/``tracestate`` headers, or None."""
    if not traceparent:
        return None
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    ctx = _W3C.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def traceparent(span: trace.Span) -> str | None:
    """The W3C ``traceparent`` that makes the next hop's spans children of ``span``."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
