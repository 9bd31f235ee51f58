"""Telemetry: the only package that configures OpenTelemetry (tracer, exporters) and the
serving metrics registry. Everyone else uses the OpenTelemetry API plus ``Telemetry``."""

from .config import TelemetryConfig, TelemetryError
from .metrics import Registry, priority_class
from .setup import Telemetry, extract, traceparent
from .tracing import new_span_id, record_phase

__all__ = ["Registry", "Telemetry", "TelemetryConfig", "TelemetryError", "extract",
           "new_span_id", "priority_class", "record_phase", "traceparent"]
