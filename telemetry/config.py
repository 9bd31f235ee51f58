"""Telemetry settings: the ``telemetry:`` section of a YAML config, then the standard
OpenTelemetry environment variables on top.

The environment wins over the file, so an operator can point a deployed process at a
collector without editing its config (the same rule as ``SLUICE_*`` overrides). Variables
honored, as the OpenTelemetry spec defines them:

``OTEL_SDK_DISABLED``, ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` (``otlp``, ``console``, ``none``),
``OTEL_EXPORTER_OTLP_ENDPOINT`` and the per-signal ``…_TRACES_ENDPOINT`` /
``…_METRICS_ENDPOINT``, ``OTEL_EXPORTER_OTLP_PROTOCOL`` (and per signal;
``http/protobuf`` or ``grpc``), ``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_EXPORTER_OTLP_TIMEOUT``
(ms), ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``, ``OTEL_BSP_SCHEDULE_DELAY``,
``OTEL_BSP_MAX_QUEUE_SIZE``, ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``, ``OTEL_METRIC_EXPORT_INTERVAL``.

Unlike the SDK's own default (``otlp``), traces and OTLP metrics are off unless configured:
``sluice up`` on a laptop must not log export errors for a collector nobody started.
Prometheus ``/metrics`` is always served.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, cast
from urllib.parse import unquote

from pydantic import BaseModel, ConfigDict, Field

Exporter = Literal["otlp", "console", "none"]
Protocol = Literal["http/protobuf", "grpc"]
SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on",
            "parentbased_always_off", "parentbased_traceidratio")


class TelemetryError(ValueError):
    """A telemetry setting (file or environment) that cannot be used."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TracesConfig(_Strict):
    exporter: Exporter = "none"
    endpoint: str | None = None  # OTLP base URL; default http://localhost:4318 (grpc: 4317)
    protocol: Protocol = "http/protobuf"
    sampler: str = "parentbased_always_on"
    sampler_arg: float | None = Field(None, ge=0, le=1)
    # Encode and send OTLP in a child process (python -m telemetry.shipper), off the
    # serving process's CPU; false: on an export thread in the serving process.
    export_process: bool = True


class MetricsConfig(_Strict):
    exporter: Exporter = "none"  # OTLP push; Prometheus /metrics is served either way
    endpoint: str | None = None
    protocol: Protocol = "http/protobuf"
    interval_s: float = Field(10.0, gt=0)
    # Label cardinality bound: past this many distinct values of one label (tenant, model)
    # in one metric, new values are recorded as "_other".
    max_label_values: int = Field(100, ge=1)


class TelemetryConfig(_Strict):
    service_name: str | None = None  # default: sluice-gateway / sluice-backend
    traces: TracesConfig = TracesConfig()
    metrics: MetricsConfig = MetricsConfig()
    timeout_s: float = Field(10.0, gt=0)  # one export call
    headers: dict[str, str] = {}  # sent with every OTLP export (auth tokens for a SaaS)


@dataclass(slots=True, frozen=True)
class ExportTarget:
    exporter: Exporter
    protocol: Protocol
    url: str  # http/protobuf: the full URL to POST to; grpc: http(s)://host:port


@dataclass(slots=True, frozen=True)
class Settings:
    """Everything resolved: what `telemetry.setup` builds from."""

    service_name: str
    resource_attributes: dict[str, str]  # from OTEL_RESOURCE_ATTRIBUTES
    traces: ExportTarget
    metrics: ExportTarget
    sampler: str
    sampler_arg: float | None
    headers: dict[str, str]
    timeout_s: float
    schedule_delay_s: float
    max_queue_size: int
    max_batch_size: int
    metrics_interval_s: float
    max_label_values: int
    export_process: bool = True

    @property
    def tracing(self) -> bool:
        return self.traces.exporter != "none" and self.sampler != "always_off"


def _parse_kv(value: str, what: str) -> dict[str, str]:
    """``k=v,k2=v2`` (W3C baggage style, values percent-decoded)."""
    out: dict[str, str] = {}
    for item in value.split(","):
        if not item.strip():
            continue
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise TelemetryError(f"{what}: expected key=value pairs, got {item!r}")
        out[key.strip()] = unquote(val.strip())
    return out


def _number(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise TelemetryError(f"{name}={raw!r} is not a number") from None


def _exporter(env: Mapping[str, str], name: str, default: Exporter) -> Exporter:
    raw = env.get(name)
    if not raw:
        return default
    # A list is allowed by the spec; we support one exporter per signal.
    first = raw.split(",")[0].strip().lower()
    if first not in ("otlp", "console", "none"):
        raise TelemetryError(f"{name}={raw!r}: supported exporters are otlp, console, none")
    return cast(Exporter, first)  # one of Exporter's values: checked just above


def _protocol(env: Mapping[str, str], signal: str, default: Protocol) -> Protocol:
    raw = env.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL") or env.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL")
    if not raw:
        return default
    if raw not in ("http/protobuf", "grpc"):
        raise TelemetryError(f"OTLP protocol {raw!r}: supported are http/protobuf and grpc")
    return cast(Protocol, raw)  # one of Protocol's values: checked just above


def _target(env: Mapping[str, str], signal: str, exporter: Exporter, protocol: Protocol,
            file_endpoint: str | None) -> ExportTarget:
    """The OTLP URL for one signal, per the spec: a per-signal endpoint is used as is; the
    general one is a base that gets ``/v1/<signal>`` appended (http/protobuf only)."""
    path = f"/v1/{signal.lower()}"
    specific = env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or file_endpoint
    if protocol == "grpc":
        url = specific or base or "http://localhost:4317"
    elif specific:
        url = specific
    else:
        url = (base or "http://localhost:4318").rstrip("/") + path
    if exporter == "otlp" and not url.startswith(("http://", "https://")):
        raise TelemetryError(f"OTLP endpoint {url!r} must start with http:// or https://")
    return ExportTarget(exporter, protocol, url)


def resolve(config: TelemetryConfig | None, default_service: str,
            env: Mapping[str, str]) -> Settings:
    """The file's settings with the environment applied; raises TelemetryError."""
    cfg = config or TelemetryConfig()
    disabled = env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    traces_exp = "none" if disabled else _exporter(env, "OTEL_TRACES_EXPORTER",
                                                   cfg.traces.exporter)
    metrics_exp = "none" if disabled else _exporter(env, "OTEL_METRICS_EXPORTER",
                                                    cfg.metrics.exporter)
    if metrics_exp == "console":
        metrics_exp = "none"  # Prometheus /metrics is the human-readable view
    sampler = (env.get("OTEL_TRACES_SAMPLER") or cfg.traces.sampler).strip().lower()
    if sampler not in SAMPLERS:
        raise TelemetryError(f"sampler {sampler!r}: supported are {', '.join(SAMPLERS)}")
    arg = cfg.traces.sampler_arg
    if env.get("OTEL_TRACES_SAMPLER_ARG"):
        arg = _number(env, "OTEL_TRACES_SAMPLER_ARG", 1.0)
        if not 0.0 <= arg <= 1.0:
            raise TelemetryError(f"OTEL_TRACES_SAMPLER_ARG={arg} must lie in [0, 1]")
    headers = dict(cfg.headers)
    if env.get("OTEL_EXPORTER_OTLP_HEADERS"):
        headers.update(_parse_kv(env["OTEL_EXPORTER_OTLP_HEADERS"], "OTEL_EXPORTER_OTLP_HEADERS"))
    resource = _parse_kv(env.get("OTEL_RESOURCE_ATTRIBUTES", ""), "OTEL_RESOURCE_ATTRIBUTES")
    # The spec's order, then the file: the environment wins over it (module docstring).
    service = env.get("OTEL_SERVICE_NAME") or resource.get(
        "service.name") or cfg.service_name or default_service
    timeout_ms = _number(env, "OTEL_EXPORTER_OTLP_TIMEOUT", cfg.timeout_s * 1000)
    batch = int(_number(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512))
    queue = int(_number(env, "OTEL_BSP_MAX_QUEUE_SIZE", 8192))
    if batch < 1 or queue < batch:
        raise TelemetryError("OTEL_BSP_MAX_EXPORT_BATCH_SIZE must be >= 1 and <= "
                             "OTEL_BSP_MAX_QUEUE_SIZE")
    return Settings(
        service_name=service,
        resource_attributes=resource,
        traces=_target(env, "TRACES", traces_exp,
                       _protocol(env, "TRACES", cfg.traces.protocol), cfg.traces.endpoint),
        metrics=_target(env, "METRICS", metrics_exp,
                        _protocol(env, "METRICS", cfg.metrics.protocol),
                        cfg.metrics.endpoint),
        sampler=sampler,
        sampler_arg=arg,
        headers=headers,
        timeout_s=max(0.001, timeout_ms / 1000),
        schedule_delay_s=max(0.01, _number(env, "OTEL_BSP_SCHEDULE_DELAY", 1000) / 1000),
        max_queue_size=queue,
        max_batch_size=batch,
        metrics_interval_s=max(0.05, _number(env, "OTEL_METRIC_EXPORT_INTERVAL",
                                             cfg.metrics.interval_s * 1000) / 1000),
        max_label_values=cfg.metrics.max_label_values,
        export_process=cfg.traces.export_process,
    )
