"""Telemetry: the only package that configures OpenTelemetry (the SDK's tracer provider,
span processors and exporters) and the serving metrics registry. Everyone else uses the
OpenTelemetry API plus ``Telemetry``."""

from .config import TelemetryConfig, TelemetryError
from .metrics import Registry, priority_class
from .setup import Telemetry, extract, traceparent

__all__ = ["Registry", "Telemetry", "TelemetryConfig", "TelemetryError", "extract",
           "priority_class", "traceparent"]
