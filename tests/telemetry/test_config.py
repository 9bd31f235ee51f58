"""Telemetry settings: the YAML section under the OTEL_* environment, what the SDK is built
with, the errors, and plugging in through the SDK's entry points."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import ConsoleSpanExporter

from gateway.config import GatewayConfig
from loadtest.targets import write_plugin
from telemetry import Telemetry
from telemetry.bench.otlp_sink import OtlpReceiver
from telemetry.config import OtlpArgs, Settings, TelemetryConfig, TelemetryError, resolve
from telemetry.setup import CountingBatch

FILE = """
service_name: from-file
timeout_s: 3
headers: {a: file, b: file}
traces:
  exporter: otlp
  endpoint: http://file-collector:4318
  sampler: always_on
metrics:
  exporter: otlp
  endpoint: http://file-collector:4318
  interval_s: 5
  max_label_values: 7
"""


def settings(env: dict[str, str] | None = None, cfg: TelemetryConfig | None = None,
             service: str = "sluice-gateway") -> Settings:
    return resolve(cfg, service, env or {})


def from_yaml(text: str = FILE) -> TelemetryConfig:
    return TelemetryConfig.model_validate(yaml.safe_load(text))


def exporters(tel: Telemetry) -> list[Any]:
    """The SDK exporters behind the provider's batch processors."""
    assert tel.provider is not None
    procs = tel.provider._active_span_processor._span_processors  # the SDK's own list
    return [p.span_exporter.inner for p in procs if isinstance(p, CountingBatch)]


# ---- what gets resolved ----------------------------------------------------------------------

def test_defaults_trace_and_push_nothing() -> None:
    s = settings()
    assert s.exporters == () and not s.tracing and s.metrics_exporter is None
    assert s.service_name == "sluice-gateway" and s.sampler == "parentbased_always_on"
    tel = Telemetry(s, "sluice.gateway")
    assert not tel.tracing and tel.provider is None and tel.pusher is None
    span = tel.tracer.start_span("x")
    assert not span.is_recording()
    tel.shutdown(1.0)


def test_the_file_alone() -> None:
    s = settings(cfg=from_yaml())
    assert s.exporters == ("otlp_proto_http",) and s.tracing
    # the file's base URL gets the signal's path, as OTEL_EXPORTER_OTLP_ENDPOINT would
    assert s.traces_otlp == OtlpArgs("http://file-collector:4318/v1/traces",
                                     {"a": "file", "b": "file"}, 3.0)
    assert s.metrics_exporter == "otlp_proto_http"
    assert s.metrics_otlp.endpoint == "http://file-collector:4318/v1/metrics"
    assert (s.sampler, s.metrics_interval_s, s.max_label_values) == ("always_on", 5.0, 7)
    assert s.service_name == "from-file"


def test_the_environment_wins_over_the_file() -> None:
    env = {"OTEL_SERVICE_NAME": "from-env", "OTEL_TRACES_EXPORTER": "console",
           "OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4318",
           "OTEL_EXPORTER_OTLP_HEADERS": "a=env", "OTEL_EXPORTER_OTLP_TIMEOUT": "1",
           "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25",
           "OTEL_METRIC_EXPORT_INTERVAL": "2000"}
    s = settings(env=env, cfg=from_yaml())
    assert s.exporters == ("console",)
    assert s.service_name is None  # the SDK's resource takes OTEL_SERVICE_NAME itself
    # nothing from the file where the environment speaks: the SDK's exporter reads it
    assert s.traces_otlp == OtlpArgs(None, None, None)
    assert (s.sampler, s.sampler_arg, s.metrics_interval_s) == (
        "parentbased_traceidratio", 0.25, 2.0)


def test_a_per_signal_variable_beats_the_file_too() -> None:
    s = settings(env={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4318/v1/traces"},
                 cfg=from_yaml())
    assert s.traces_otlp.endpoint is None
    assert s.metrics_otlp.endpoint == "http://file-collector:4318/v1/metrics"


@pytest.mark.parametrize(("env", "want"), [
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, ("otlp_proto_grpc", "otlp_proto_grpc")),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
      "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
     ("otlp_proto_http", "otlp_proto_grpc")),
    ({}, ("otlp_proto_http", "otlp_proto_http")),  # the specification's default
])
def test_otlp_means_the_protocols_exporter(env: dict[str, str], want: tuple[str, str]) -> None:
    s = settings(env={"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp", **env})
    assert (s.exporters[0], s.metrics_exporter) == want


def test_a_grpc_endpoint_from_the_file_takes_no_path() -> None:
    cfg = TelemetryConfig.model_validate({"traces": {
        "exporter": "otlp", "protocol": "grpc", "endpoint": "http://c:4317"}})
    assert settings(cfg=cfg).traces_otlp.endpoint == "http://c:4317"


def test_several_exporters_and_none() -> None:
    assert settings(env={"OTEL_TRACES_EXPORTER": "otlp,console"}).exporters == (
        "otlp_proto_http", "console")
    assert settings(env={"OTEL_TRACES_EXPORTER": "none"}, cfg=from_yaml()).exporters == ()


@pytest.mark.parametrize("value", ["true", "TRUE"])
def test_sdk_disabled_turns_everything_off(value: str) -> None:
    s = settings(env={"OTEL_SDK_DISABLED": value, "OTEL_TRACES_EXPORTER": "otlp",
                      "OTEL_METRICS_EXPORTER": "otlp"})
    assert not s.tracing and s.metrics_exporter is None


def test_always_off_sampler_means_no_tracing() -> None:
    assert not settings(env={"OTEL_TRACES_EXPORTER": "otlp",
                             "OTEL_TRACES_SAMPLER": "always_off"}).tracing


def test_console_metrics_exporter_means_no_push() -> None:
    assert settings(env={"OTEL_METRICS_EXPORTER": "console"}).metrics_exporter is None


@pytest.mark.parametrize(("env", "message"), [
    ({"OTEL_TRACES_SAMPLER": "sometimes"}, "sampler 'sometimes'"),
    ({"OTEL_TRACES_SAMPLER_ARG": "half"}, "is not a number"),
    ({"OTEL_TRACES_SAMPLER_ARG": "2"}, "must lie in [0, 1]"),
    ({"OTEL_TRACES_EXPORTER": "jaeger"}, "trace exporter 'jaeger' is not installed"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTLP protocol 'http/json'"),
    ({"OTEL_METRICS_EXPORTER": "statsd"}, "metrics exporter statsd"),
    ({"OTEL_METRIC_EXPORT_INTERVAL": "soon"}, "OTEL_METRIC_EXPORT_INTERVAL"),
])
def test_bad_settings_raise_clear_errors(env: dict[str, str], message: str) -> None:
    with pytest.raises(TelemetryError) as err:
        settings(env={"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp", **env})
    assert message in str(err.value)


@pytest.mark.parametrize("env", [
    {"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp",
     "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json", "OTEL_TRACES_SAMPLER": "xray",
     "OTEL_METRICS_EXPORTER": "statsd"},
    # a cluster-wide value meant for other services: nothing here uses it
    {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json", "OTEL_TRACES_SAMPLER": "xray"},
])
def test_settings_of_signals_that_are_off_are_not_checked(env: dict[str, str]) -> None:
    s = settings(env=env)
    assert not s.tracing and s.metrics_exporter is None


def test_file_headers_are_lower_cased_for_grpc_metadata() -> None:
    cfg = TelemetryConfig.model_validate({"headers": {"Authorization": "Bearer t"},
                                          "traces": {"exporter": "otlp", "protocol": "grpc"}})
    assert settings(cfg=cfg).traces_otlp.headers == {"authorization": "Bearer t"}


def test_a_resource_key_ending_in_service_name_does_not_name_the_service() -> None:
    env = {"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment.name=prod,k8s.service.name=llm"}
    assert settings(env=env).service_name == "sluice-gateway"
    env = {"OTEL_RESOURCE_ATTRIBUTES": "k8s.service.name=llm, service.name=mine"}
    assert settings(env=env).service_name is None  # the SDK's resource takes it


def test_telemetry_error_is_a_value_error_and_create_raises_it() -> None:
    assert issubclass(TelemetryError, ValueError)
    with pytest.raises(TelemetryError):
        Telemetry.create("sluice-gateway", env={"OTEL_TRACES_EXPORTER": "console",
                                                "OTEL_TRACES_SAMPLER": "never"})


def test_bad_file_settings_are_errors_too() -> None:
    with pytest.raises(TelemetryError, match="sampler 'sometimes'"):
        settings(cfg=TelemetryConfig.model_validate({"traces": {
            "exporter": "console", "sampler": "sometimes"}}))
    with pytest.raises(TelemetryError, match="must start with http"):
        settings(cfg=TelemetryConfig.model_validate({"traces": {
            "exporter": "otlp", "endpoint": "collector:4318"}}))
    with pytest.raises(TelemetryError, match="'jaeger' is not installed"):
        settings(cfg=TelemetryConfig.model_validate({"traces": {"exporter": "jaeger"}}))


# ---- what the SDK is built with ----------------------------------------------------------

def test_the_sdk_exporters_get_the_files_values() -> None:
    cfg = from_yaml().model_copy(update={"metrics": TelemetryConfig().metrics})
    tel = Telemetry(settings(cfg=cfg), "sluice.gateway")
    try:
        [exp] = exporters(tel)
        assert isinstance(exp, OTLPSpanExporter)
        assert exp._endpoint == "http://file-collector:4318/v1/traces"  # the SDK's field
    finally:
        tel.provider.shutdown()  # type: ignore[union-attr]  # built: tracing is on


def test_grpc_and_console_exporters_each_counted() -> None:
    out = io.StringIO()
    tel = Telemetry(settings(env={"OTEL_TRACES_EXPORTER": "otlp,console",
                                  "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
                             cfg=TelemetryConfig(timeout_s=0.2)), "s")
    try:
        kinds = [type(e) for e in exporters(tel)]
        assert kinds == [GrpcSpanExporter, ConsoleSpanExporter]
        exporters(tel)[1].out = out  # the console exporter's stream
        tel.tracer.start_span("both").end()
        tel.force_flush(5)
        assert json.loads(out.getvalue())["name"] == "both"
        # nothing listens on localhost:4317: that exporter fails, the console one does not
        assert [(c.exported, c.failed, c.dropped) for c in tel.counts] == [(0, 1, 0),
                                                                          (1, 0, 0)]
        assert tel.span_counts() == (1, 1, 0)
    finally:
        tel.shutdown(0.5)


def test_the_resource_is_the_sdks_with_the_environment_winning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    tel = Telemetry(settings(cfg=from_yaml()), "s", version="9.9")
    r = dict(tel.resource.attributes)
    assert r["service.name"] == "from-file" and r["service.version"] == "9.9"
    assert r["telemetry.sdk.name"] == "opentelemetry"
    assert r["telemetry.sdk.language"] == "python" and r["service.instance.id"]
    tel.shutdown(0.5)
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES",
                       "service.name=from-attrs,deployment.environment.name=prod")
    env = {"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attrs"}
    tel = Telemetry(settings(env=env, cfg=from_yaml()), "s")
    r = dict(tel.resource.attributes)
    assert r["service.name"] == "from-attrs" and r["deployment.environment.name"] == "prod"
    tel.shutdown(0.5)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    tel = Telemetry(settings(env={"OTEL_SERVICE_NAME": "from-env"}, cfg=from_yaml()), "s")
    assert tel.resource.attributes["service.name"] == "from-env"
    tel.shutdown(0.5)


def test_the_sampler_comes_from_the_sdks_entry_points() -> None:
    for name, arg, want in [("always_off", None, "AlwaysOffSampler"),
                            ("parentbased_traceidratio", 0.1,
                             "ParentBased{root:TraceIdRatioBased{0.1}"),
                            ("traceidratio", None, "TraceIdRatioBased{1.0}")]:
        s = settings(env={"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": name,
                          **({"OTEL_TRACES_SAMPLER_ARG": str(arg)} if arg else {})})
        if not s.tracing:
            continue  # always_off: nothing is built
        tel = Telemetry(s, "s")
        assert tel.provider is not None
        assert tel.provider.sampler.get_description().startswith(want)
        tel.shutdown(0.5)


def test_spans_reach_a_real_collector_from_the_files_settings() -> None:
    with OtlpReceiver() as rx:
        cfg = TelemetryConfig.model_validate({"traces": {
            "exporter": "otlp", "endpoint": rx.endpoint}})
        tel = Telemetry(settings(cfg=cfg), "sluice.gateway")
        tel.tracer.start_span("probe").end()
        assert tel.force_flush(5)
        [span] = rx.wait_for(lambda s: any(x.name == "probe" for x in s), timeout=10)
        assert span.resource["telemetry.sdk.name"] == "opentelemetry"
        assert span.scope == "sluice.gateway"
        tel.shutdown(2)
        assert tel.span_counts() == (1, 0, 0)  # exported, failed, dropped


# ---- plugging in through the SDK's entry points -----------------------------------------------

PLUGIN = '''
import threading

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

SEEN = []
RELEASE = threading.Event()


class MemoryExporter(SpanExporter):
    def export(self, spans):
        SEEN.extend(s.name for s in spans)
        return SpanExportResult.SUCCESS


class StuckExporter(SpanExporter):
    """A collector that never answers (until the test lets it go)."""

    def export(self, spans):
        RELEASE.wait(120)
        return SpanExportResult.FAILURE
'''


def plugin(tmp_path: Path) -> Path:
    """An installed distribution with a trace exporter under the SDK's entry point."""
    return write_plugin(tmp_path, "sluice_test_plugin", PLUGIN,
                        {"memory": "MemoryExporter", "stuck": "StuckExporter"})


def test_an_exporter_plugin_is_chosen_by_name(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(plugin(tmp_path)))
    s = settings(env={"OTEL_TRACES_EXPORTER": "memory,console"})
    assert s.exporters == ("memory", "console")
    tel = Telemetry(settings(env={"OTEL_TRACES_EXPORTER": "memory"}), "s")
    tel.tracer.start_span("to-the-plugin").end()
    assert tel.force_flush(5)
    import sluice_test_plugin  # type: ignore[import-not-found]  # written by plugin()

    assert sluice_test_plugin.SEEN == ["to-the-plugin"]
    tel.shutdown(1)
    monkeypatch.delitem(sys.modules, "sluice_test_plugin")


def test_shutdown_is_bounded_when_the_collector_never_answers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK's flush ignores its timeout; Telemetry's does not (a stopping process has a
    grace period)."""
    monkeypatch.syspath_prepend(str(plugin(tmp_path)))
    tel = Telemetry(settings(env={"OTEL_TRACES_EXPORTER": "stuck"}), "s")
    import sluice_test_plugin  # type: ignore[import-not-found]  # written by plugin()

    try:
        for i in range(600):  # two batches: the first blocks the export thread
            tel.tracer.start_span(f"s{i}").end()
        started = time.monotonic()
        assert tel.force_flush(0.2) is False
        tel.shutdown(0.5)
        assert time.monotonic() - started < 30  # unbounded: until the exporter lets go
    finally:
        sluice_test_plugin.RELEASE.set()
        monkeypatch.delitem(sys.modules, "sluice_test_plugin")


OPERATOR = '''
import json, sys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider, SpanProcessor
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

class Tag(SpanProcessor):  # the operator's own processor
    def on_start(self, span, parent_context=None):
        span.set_attribute("operator.tag", "yes")

memory = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(Tag())
provider.add_span_processor(SimpleSpanProcessor(memory))
trace.set_tracer_provider(provider)  # as opentelemetry-instrument or a sitecustomize does

from telemetry import Telemetry
tel = Telemetry.create("sluice-gateway", env={})  # Sluice's own settings: traces off
tel.tracer.start_span("sluice-span").end()
tel.shutdown(1)
print(json.dumps({"tracing": tel.tracing, "describe": tel.describe(),
                  "spans": [(s.name, s.attributes.get("operator.tag"))
                            for s in memory.get_finished_spans()]}))
'''


def test_an_operators_tracer_provider_is_used_as_it_is() -> None:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(OPERATOR)], check=True,
                         capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["tracing"] is True
    assert got["spans"] == [["sluice-span", "yes"]]
    assert "the process's own TracerProvider" in got["describe"]


# ---- the YAML section --------------------------------------------------------------------------

MODELS = [{"name": "m", "upstream": "http://x"}]


def test_gateway_config_accepts_a_telemetry_section() -> None:
    cfg = GatewayConfig.model_validate({"models": MODELS, "telemetry": {
        "service_name": "gw",
        "headers": {"authorization": "Bearer t"},
        "traces": {"exporter": "otlp", "endpoint": "http://c:4317", "protocol": "grpc",
                   "sampler": "parentbased_traceidratio", "sampler_arg": 0.1},
        "metrics": {"exporter": "otlp", "interval_s": 30, "max_label_values": 20},
    }})
    t = cfg.telemetry
    assert t.service_name == "gw" and t.headers == {"authorization": "Bearer t"}
    assert (t.traces.exporter, t.traces.protocol, t.traces.sampler_arg) == ("otlp", "grpc",
                                                                           0.1)
    assert (t.metrics.interval_s, t.metrics.max_label_values) == (30, 20)
    s = resolve(t, "sluice-gateway", {})
    assert s.traces_otlp.endpoint == "http://c:4317" and s.exporters == ("otlp_proto_grpc",)
    assert s.traces_otlp.headers == {"authorization": "Bearer t"}
    # absent: the defaults
    assert GatewayConfig.model_validate({"models": MODELS}).telemetry == TelemetryConfig()


@pytest.mark.parametrize("section", [
    {"tracing": {"exporter": "otlp"}},
    {"traces": {"exporterr": "otlp"}},
    {"traces": {"export_process": True}},  # the shipper is gone
    {"metrics": {"exporter": "otlp", "port": 9090}},
    {"traces": {"protocol": "http/json"}},
    {"traces": {"sampler_arg": 1.5}},
    {"metrics": {"max_label_values": 0}},
    {"timeout_s": 0},
])
def test_gateway_config_rejects_bad_telemetry_keys(section: dict[str, Any]) -> None:
    with pytest.raises(pydantic.ValidationError) as err:
        GatewayConfig.model_validate({"models": MODELS, "telemetry": section})
    assert any(e["loc"][0] == "telemetry" for e in err.value.errors())


# ---- the start-up log line -------------------------------------------------------------------

def test_the_start_up_line_names_what_is_used(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sluice.telemetry")
    tel = Telemetry.create("sluice-gateway", env={"OTEL_TRACES_EXPORTER": "console"})
    tel.shutdown(1.0)
    line = next(r.getMessage() for r in caplog.records if r.name == "sluice.telemetry")
    assert line == ("telemetry: service sluice-gateway, traces to console (sampler "
                    "parentbased_always_on), OTLP metrics off")


@pytest.mark.parametrize(("env", "said"), [
    ({}, "traces off, OTLP metrics off"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_TRACES_SAMPLER": "always_off"},
     "traces off, OTLP metrics off"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
      "OTEL_TRACES_SAMPLER_ARG": "0.1"},
     "traces to otlp_proto_http (sampler parentbased_traceidratio 0.1), OTLP metrics off"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
      "OTEL_METRICS_EXPORTER": "otlp", "OTEL_METRIC_EXPORT_INTERVAL": "5000"},
     ("traces to otlp_proto_grpc (sampler parentbased_always_on), "
      "OTLP metrics through otlp_proto_grpc every 5 s")),
])
def test_the_start_up_line_for_each_exporter(env: dict[str, str], said: str) -> None:
    # (a short export timeout: the last metrics push at shutdown finds no collector)
    tel = Telemetry(settings(env=env, cfg=TelemetryConfig(timeout_s=0.2)), "s")
    assert tel.describe() == f"service sluice-gateway, {said}"
    tel.shutdown(0.5)
