"""``Telemetry``: the one object a process builds to trace and measure itself.

Tracing is the stock OpenTelemetry SDK: a ``TracerProvider`` with the configured sampler
and resource, and a ``BatchSpanProcessor`` per exporter, each exporter loaded from the SDK's
``opentelemetry_traces_exporter`` entry points (``otlp`` is the OTLP/HTTP or OTLP/gRPC
exporter; any installed plugin is chosen by its name in ``OTEL_TRACES_EXPORTER``). When the
process already has an SDK ``TracerProvider`` installed globally (``opentelemetry-instrument``,
a distro, a ``sitecustomize``), Sluice uses that one as it is, with its processors and
exporters. Otherwise the provider built here becomes the global one if none is set, so
instrumentation libraries (httpx, redis, ...) record into the same traces.

The gateway and the backend each build one in their lifespan from their YAML section (or
none) plus the environment, take ``.tracer`` and ``.registry`` from it, and call
``shutdown()`` on the way out, which flushes queued spans and pushes the last metrics.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import platform
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import Sampler
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .config import (
    METRICS_EXPORTERS,
    SAMPLERS,
    TRACES_EXPORTERS,
    OtlpArgs,
    Settings,
    TelemetryConfig,
    TelemetryError,
    resolve,
)
from .metrics import Family, Registry
from .push import MetricsPusher

log = logging.getLogger("sluice.telemetry")

_W3C = TraceContextTextMapPropagator()
_LOG_EVERY_S = 30.0
_OURS: weakref.WeakSet[TracerProvider] = weakref.WeakSet()  # providers Telemetry built
_SDK_QUEUE_SIZE = 2048  # BatchSpanProcessor's default max_queue_size


def sluice_version() -> str:
    try:
        return importlib.metadata.version("sluice")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


class SpanCounts:
    """What happened to the spans one exporter was given: exported, refused (after the
    SDK's retries), or dropped because its batch queue was full."""

    __slots__ = ("_lock", "_unlogged", "dropped", "ended", "exported", "failed", "handed",
                 "last_log")

    def __init__(self) -> None:
        self.ended = self.handed = self.exported = self.failed = self.dropped = 0
        self._lock = threading.Lock()
        self._unlogged = 0
        self.last_log = -_LOG_EVERY_S

    def export_failed(self, n: int, exporter: str) -> None:
        with self._lock:
            self.failed += n
            self._unlogged += n
            now = time.monotonic()
            if now - self.last_log < _LOG_EVERY_S:
                return
            n, self._unlogged, self.last_log = self._unlogged, 0, now
        log.warning("span export through %s failed: %d spans dropped since the last message "
                    "(the exporter logs why)", exporter, n)


class CountingExporter(SpanExporter):
    """An SDK exporter, counted: the batch processor hands it each batch."""

    def __init__(self, inner: SpanExporter, name: str, counts: SpanCounts) -> None:
        self.inner = inner
        self.name = name
        self.counts = counts

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        n = len(spans)
        self.counts.handed += n
        try:
            result = self.inner.export(spans)
        except Exception:
            log.exception("span exporter %s raised", self.name)
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.counts.exported += n
        else:
            self.counts.export_failed(n, self.name)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def _queue_size() -> int:
    """``OTEL_BSP_MAX_QUEUE_SIZE`` as the SDK reads it (a bad value: its default, logged)."""
    raw = os.environ.get("OTEL_BSP_MAX_QUEUE_SIZE", "")
    try:
        return int(raw) if raw.strip() else _SDK_QUEUE_SIZE
    except ValueError:
        log.warning("OTEL_BSP_MAX_QUEUE_SIZE=%r is not an integer: %d", raw, _SDK_QUEUE_SIZE)
        return _SDK_QUEUE_SIZE


class CountingBatch(BatchSpanProcessor):
    """The SDK's batch processor for one exporter, counting the spans it is given and
    those its full queue drops (the SDK drops the oldest and logs it; the count is
    estimated from the spans handed to the exporter, so it can read high by a batch while
    one is being taken)."""

    def __init__(self, exporter: CountingExporter) -> None:
        self.max_queue = _queue_size()
        super().__init__(exporter, max_queue_size=self.max_queue)
        self.counts = exporter.counts

    def on_end(self, span: ReadableSpan) -> None:
        c = self.counts
        c.ended += 1
        if c.ended - c.handed - c.dropped > self.max_queue:
            c.dropped += 1
        super().on_end(span)


def _entry_point(group: str, name: str) -> Any:
    """What the SDK's entry point ``name`` of ``group`` names (checked to exist by
    ``telemetry.config``)."""
    return next(iter(importlib.metadata.entry_points(group=group, name=name))).load()


def _sampler(name: str, arg: float | None) -> Sampler:
    factory = _entry_point(SAMPLERS, name)
    sampler = factory(1.0 if arg is None and name.endswith("traceidratio") else arg)
    if not isinstance(sampler, Sampler):
        raise TelemetryError(f"sampler {name!r} made {sampler!r}, not a Sampler")
    return sampler


def _exporter(group: str, name: str, otlp: OtlpArgs) -> Any:
    """An exporter from the SDK's entry points; the OTLP ones get the file's values where
    the environment set none (``OtlpArgs``), any other is built as its package says."""
    kwargs: dict[str, Any] = {}
    if name in ("otlp_proto_http", "otlp_proto_grpc"):
        if otlp.endpoint is not None:
            kwargs["endpoint"] = otlp.endpoint
            if name == "otlp_proto_grpc":
                kwargs["insecure"] = otlp.endpoint.startswith("http://")
        if otlp.headers is not None:
            kwargs["headers"] = otlp.headers
        if otlp.timeout_s is not None:
            kwargs["timeout"] = otlp.timeout_s
    return _entry_point(group, name)(**kwargs)


def _span_exporter(name: str, otlp: OtlpArgs) -> SpanExporter:
    exporter = _exporter(TRACES_EXPORTERS, name, otlp)
    if not isinstance(exporter, SpanExporter):
        raise TelemetryError(f"trace exporter {name!r} made {exporter!r}, not a SpanExporter")
    return exporter


def _resource(settings: Settings, version: str) -> Resource:
    """The SDK's resource (``telemetry.sdk.*``, ``OTEL_RESOURCE_ATTRIBUTES``,
    ``OTEL_SERVICE_NAME``) over Sluice's defaults: the environment wins."""
    defaults: dict[str, Any] = {
        "service.version": version,
        "service.instance.id": uuid.uuid4().hex,
        "host.name": platform.node(),
        "process.pid": os.getpid(),
    }
    if settings.service_name is not None:
        defaults["service.name"] = settings.service_name
    env = Resource.create({})  # the default resource with the environment's attributes
    attrs = dict(defaults)
    for key, value in env.attributes.items():
        if key == "service.name" and settings.service_name is not None:
            continue  # the SDK's "unknown_service" placeholder: the environment set none
        attrs[key] = value
    return Resource(attrs, env.schema_url)


class Telemetry:
    def __init__(self, settings: Settings, scope: str, version: str | None = None) -> None:
        self.settings = settings
        self.version = version or sluice_version()
        self.resource = _resource(settings, self.version)
        self.registry = Registry(settings.max_label_values)
        self.counts: list[SpanCounts] = []  # one per exporter
        self.provider: TracerProvider | None = None
        self.owned = False  # the provider is ours to flush and shut down
        self.tracer: trace.Tracer = trace.NoOpTracer()
        current = trace.get_tracer_provider()
        if isinstance(current, TracerProvider) and current not in _OURS:
            self.provider = current  # the operator's (opentelemetry-instrument, a distro)
        elif settings.tracing:
            provider = TracerProvider(sampler=_sampler(settings.sampler, settings.sampler_arg),
                                      resource=self.resource)
            for name in settings.exporters:
                counts = SpanCounts()
                self.counts.append(counts)
                exporter = CountingExporter(_span_exporter(name, settings.traces_otlp), name,
                                            counts)
                provider.add_span_processor(CountingBatch(exporter))
            _OURS.add(provider)
            if isinstance(current, trace.ProxyTracerProvider):
                trace.set_tracer_provider(provider)
            self.provider, self.owned = provider, True
        if self.provider is not None:
            self.tracer = self.provider.get_tracer(scope, self.version)
        self.pusher: MetricsPusher | None = None
        if settings.metrics_exporter is not None:
            self.pusher = MetricsPusher(
                self.registry, _exporter(METRICS_EXPORTERS, settings.metrics_exporter,
                                         settings.metrics_otlp),
                settings.metrics_interval_s, self.resource, scope, self.version)
        self.registry.collector(self._self_metrics)

    @classmethod
    def create(cls, service: str, config: TelemetryConfig | None = None,
               env: Mapping[str, str] | None = None, scope: str | None = None) -> Telemetry:
        """Resolve the settings (raises ``TelemetryError`` on bad ones) and build."""
        settings = resolve(config, service, os.environ if env is None else env)
        try:
            tel = cls(settings, scope or service.replace("-", "."))
        except (ValueError, ImportError) as exc:  # e.g. OTEL_BSP_* the SDK refuses
            raise TelemetryError(f"telemetry: {exc}") from exc
        log.info("telemetry: %s", tel.describe())
        return tel

    @property
    def tracing(self) -> bool:
        """False when spans go nowhere: callers skip building attributes at all."""
        return self.provider is not None

    def describe(self) -> str:
        """Where spans and pushed metrics go, for the start-up log."""
        s = self.settings
        name = self.resource.attributes.get("service.name")
        if self.provider is not None and not self.owned:
            traces = "traces through the process's own TracerProvider"
        elif self.provider is not None:
            traces = (f"traces to {', '.join(s.exporters)} (sampler {s.sampler}"
                      + (f" {s.sampler_arg:g}" if s.sampler_arg is not None else "") + ")")
        else:
            traces = "traces off"
        metrics = (f"OTLP metrics through {s.metrics_exporter} every "
                   f"{s.metrics_interval_s:g} s" if s.metrics_exporter else "OTLP metrics off")
        return f"service {name}, {traces}, {metrics}"

    def span_counts(self) -> tuple[int, int, int]:
        """Spans exported, failed and dropped, summed over the exporters."""
        return (sum(c.exported for c in self.counts), sum(c.failed for c in self.counts),
                sum(c.dropped for c in self.counts))

    def _self_metrics(self) -> Iterable[Family]:
        exported, failed, dropped = self.span_counts()
        fam = Family("sluice_telemetry_spans_total", "counter",
                     "Spans by fate, summed over the exporters: exported, export_failed (the "
                     "exporter gave up after the SDK's retries), dropped_queue_full.")
        fam.add(exported, result="exported")
        fam.add(failed, result="export_failed")
        fam.add(dropped, result="dropped_queue_full")
        yield fam
        if self.pusher is not None:
            yield Family("sluice_telemetry_metric_export_failures_total", "counter",
                         "OTLP metric exports that failed.").add(self.pusher.failures)

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """Export what is queued; True when done within ``timeout_s`` (the SDK's own flush
        does not stop at its timeout: a collector that is down makes every batch wait out
        the exporter's retries, so it runs on a thread this call stops waiting for)."""
        provider = self.provider
        if provider is None:
            return True
        return _within(lambda: provider.force_flush(int(timeout_s * 1000)), timeout_s)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Flush and close, all of it within ``timeout_s`` (a process being stopped has a
        grace period): spans first, then the last metrics push with the time left."""
        deadline = time.monotonic() + timeout_s
        provider = self.provider
        if provider is not None:
            flushed = self.force_flush(timeout_s)
            if self.owned:
                flushed = _within(provider.shutdown, deadline - time.monotonic()) and flushed
            if not flushed:
                log.warning("telemetry: spans still queued after %.1f s at shutdown, dropped",
                            timeout_s)
        pusher = self.pusher
        if pusher is not None:
            left = max(0.0, deadline - time.monotonic())
            if not _within(lambda: pusher.shutdown(left), left):
                log.warning("telemetry: the last OTLP metrics push did not finish in time")


def _within(fn: Callable[[], object], timeout_s: float) -> bool:
    """Run ``fn`` on a daemon thread; True when it returned within ``timeout_s``."""
    done = threading.Event()

    def run() -> None:
        try:
            fn()
        except Exception:
            log.warning("telemetry: flushing failed", exc_info=True)
        finally:
            done.set()

    threading.Thread(target=run, name="sluice-telemetry-flush", daemon=True).start()
    return done.wait(max(0.0, timeout_s))


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
