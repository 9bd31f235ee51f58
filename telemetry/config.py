"""Telemetry settings: the ``telemetry:`` section of a YAML config, under the standard
OpenTelemetry environment variables.

The OpenTelemetry SDK reads the environment itself: the OTLP exporters take their endpoint,
headers, timeout, compression and TLS files from ``OTEL_EXPORTER_OTLP_*``, the batch span
processor its sizes from ``OTEL_BSP_*``, the resource ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES``. This module only decides what to build (which exporters, which
sampler) and hands the file's values to the SDK where the environment says nothing, so the
environment always wins over the file, as the specification says.

Two differences from the SDK's own defaults, both so that ``sluice up`` on a laptop logs no
export errors for a collector nobody started: traces and OTLP metrics are off unless the
file or ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` turn them on, and ``otlp``
means OTLP/HTTP (``http/protobuf``, the specification's default) unless
``OTEL_EXPORTER_OTLP_PROTOCOL`` says ``grpc``. Prometheus ``/metrics`` is always served.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Protocol = Literal["http/protobuf", "grpc"]
PROTOCOLS: tuple[Protocol, ...] = ("http/protobuf", "grpc")
TRACES_EXPORTERS = "opentelemetry_traces_exporter"  # the SDK's entry-point groups
METRICS_EXPORTERS = "opentelemetry_metrics_exporter"
SAMPLERS = "opentelemetry_traces_sampler"
_OTLP_ENTRY = {"http/protobuf": "otlp_proto_http", "grpc": "otlp_proto_grpc"}


class TelemetryError(ValueError):
    """A telemetry setting (file or environment) that cannot be used."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TracesConfig(_Strict):
    # otlp | console | none, or any exporter installed under the SDK's
    # ``opentelemetry_traces_exporter`` entry points; a comma-separated list for several.
    exporter: str = "none"
    endpoint: str | None = None  # OTLP base URL; default http://localhost:4318 (grpc: 4317)
    protocol: Protocol = "http/protobuf"
    sampler: str = "parentbased_always_on"  # a name of the SDK's sampler entry points
    sampler_arg: float | None = Field(None, ge=0, le=1)


class MetricsConfig(_Strict):
    exporter: Literal["otlp", "console", "none"] = "none"  # OTLP push; /metrics either way
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
class OtlpArgs:
    """Constructor arguments for an SDK OTLP exporter: the file's values, each only where
    the environment sets nothing for it (None: the exporter reads its own variable)."""

    endpoint: str | None = None
    headers: dict[str, str] | None = None
    timeout_s: float | None = None


@dataclass(slots=True, frozen=True)
class Settings:
    """Everything resolved: what ``telemetry.setup`` builds from."""

    service_name: str | None  # None: the environment names the service
    exporters: tuple[str, ...]  # entry-point names in opentelemetry_traces_exporter
    traces_otlp: OtlpArgs
    sampler: str
    sampler_arg: float | None
    metrics_exporter: str | None  # otlp_proto_http | otlp_proto_grpc | None
    metrics_otlp: OtlpArgs
    metrics_interval_s: float
    max_label_values: int

    @property
    def tracing(self) -> bool:
        return bool(self.exporters) and self.sampler != "always_off"


def entry_point_names(group: str) -> set[str]:
    return set(importlib.metadata.entry_points(group=group).names)


def _protocol(env: Mapping[str, str], signal: str, file_value: Protocol) -> Protocol:
    raw = (env.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL")
           or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or file_value).strip()
    if raw == "grpc":
        return "grpc"
    if raw != "http/protobuf":
        raise TelemetryError(f"OTLP protocol {raw!r}: supported are http/protobuf and grpc")
    return "http/protobuf"


def _exporter_names(raw: str, env: Mapping[str, str], signal: str,
                    file_protocol: Protocol) -> tuple[str, ...]:
    """The spec's exporter list as entry-point names: ``otlp`` becomes the protocol's
    exporter, ``none`` alone means none."""
    names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    if names == ["none"] or not names:
        return ()
    known = entry_point_names(TRACES_EXPORTERS)
    out: list[str] = []
    for name in names:
        if name == "otlp":
            name = _OTLP_ENTRY[_protocol(env, signal, file_protocol)]
        if name not in known:
            raise TelemetryError(
                f"trace exporter {name!r} is not installed (entry point group "
                f"{TRACES_EXPORTERS}: {', '.join(sorted(known))}); otlp, console and none "
                "are built in")
        if name not in out:
            out.append(name)
    return tuple(out)


def _otlp_args(env: Mapping[str, str], signal: str, protocol: Protocol,
               cfg: TelemetryConfig, file_endpoint: str | None) -> OtlpArgs:
    """The file's endpoint, headers and timeout where the environment has none. A file
    endpoint is a base URL, as ``OTEL_EXPORTER_OTLP_ENDPOINT``: HTTP gets the signal's
    path appended."""
    endpoint = None
    if file_endpoint and not (env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
                              or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
        if not file_endpoint.startswith(("http://", "https://")):
            raise TelemetryError(f"OTLP endpoint {file_endpoint!r} must start with http:// "
                                 "or https://")
        endpoint = (file_endpoint if protocol == "grpc"
                    else file_endpoint.rstrip("/") + f"/v1/{signal.lower()}")
    headers = None  # gRPC metadata keys must be lower case; HTTP ignores case
    if cfg.headers and not (env.get(f"OTEL_EXPORTER_OTLP_{signal}_HEADERS")
                            or env.get("OTEL_EXPORTER_OTLP_HEADERS")):
        headers = {k.lower(): v for k, v in cfg.headers.items()}
    timeout = None
    if not (env.get(f"OTEL_EXPORTER_OTLP_{signal}_TIMEOUT")
            or env.get("OTEL_EXPORTER_OTLP_TIMEOUT")):
        timeout = cfg.timeout_s
    return OtlpArgs(endpoint, headers, timeout)


def _sampler(env: Mapping[str, str], cfg: TracesConfig) -> tuple[str, float | None]:
    name = (env.get("OTEL_TRACES_SAMPLER") or cfg.sampler).strip().lower()
    known = entry_point_names(SAMPLERS)
    if name not in known:
        raise TelemetryError(f"sampler {name!r}: installed are {', '.join(sorted(known))}")
    arg = cfg.sampler_arg
    raw = env.get("OTEL_TRACES_SAMPLER_ARG")
    if raw:
        try:
            arg = float(raw)
        except ValueError:
            raise TelemetryError(f"OTEL_TRACES_SAMPLER_ARG={raw!r} is not a number") from None
        if not 0.0 <= arg <= 1.0:
            raise TelemetryError(f"OTEL_TRACES_SAMPLER_ARG={arg} must lie in [0, 1]")
    return name, arg


def resolve(config: TelemetryConfig | None, default_service: str,
            env: Mapping[str, str]) -> Settings:
    """The file's settings under the environment; raises TelemetryError. A signal that is
    off is not checked further (``OTEL_SDK_DISABLED=true`` ignores every other variable)."""
    cfg = config or TelemetryConfig()
    disabled = env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    exporters: tuple[str, ...] = ()
    sampler, arg = cfg.traces.sampler, cfg.traces.sampler_arg
    traces_otlp = OtlpArgs()
    raw_exporters = env.get("OTEL_TRACES_EXPORTER") or cfg.traces.exporter
    if not disabled and raw_exporters.strip().lower() not in ("", "none"):
        exporters = _exporter_names(raw_exporters, env, "TRACES", cfg.traces.protocol)
        sampler, arg = _sampler(env, cfg.traces)
        traces_otlp = _otlp_args(env, "TRACES", _protocol(env, "TRACES", cfg.traces.protocol),
                                 cfg, cfg.traces.endpoint)
    metrics_raw = (env.get("OTEL_METRICS_EXPORTER") or cfg.metrics.exporter).strip().lower()
    metrics_names = [n.strip() for n in metrics_raw.split(",") if n.strip()]
    metrics_exporter, metrics_otlp = None, OtlpArgs()
    if not disabled:
        unknown = set(metrics_names) - {"otlp", "console", "none", "prometheus"}
        if unknown:
            raise TelemetryError(f"metrics exporter {', '.join(sorted(unknown))}: supported "
                                 "are otlp (push) and none (console and prometheus are "
                                 "accepted and ignored: /metrics is always served)")
        if "otlp" in metrics_names:
            protocol = _protocol(env, "METRICS", cfg.metrics.protocol)
            metrics_exporter = _OTLP_ENTRY[protocol]
            metrics_otlp = _otlp_args(env, "METRICS", protocol, cfg, cfg.metrics.endpoint)
    service = None
    if not _env_names_service(env):
        service = cfg.service_name or default_service
    interval_ms = env.get("OTEL_METRIC_EXPORT_INTERVAL")
    try:
        interval_s = float(interval_ms) / 1000 if interval_ms else cfg.metrics.interval_s
    except ValueError:
        raise TelemetryError(f"OTEL_METRIC_EXPORT_INTERVAL={interval_ms!r} is not a number") \
            from None
    return Settings(
        service_name=service,
        exporters=exporters,
        traces_otlp=traces_otlp,
        sampler=sampler,
        sampler_arg=arg,
        metrics_exporter=metrics_exporter,
        metrics_otlp=metrics_otlp,
        metrics_interval_s=max(0.05, interval_s),
        max_label_values=cfg.metrics.max_label_values,
    )


def _env_names_service(env: Mapping[str, str]) -> bool:
    """Whether the environment names the service: ``OTEL_SERVICE_NAME``, or the exact key
    ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES`` (not ``k8s.service.name``)."""
    if env.get("OTEL_SERVICE_NAME"):
        return True
    for item in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, sep, _ = item.partition("=")
        if sep and key.strip() == "service.name":
            return True
    return False
