"""Telemetry settings: the YAML section, the OTEL_* environment on top, and the errors."""

from __future__ import annotations

import logging

import pydantic
import pytest
import yaml

from gateway.config import GatewayConfig
from telemetry import Telemetry
from telemetry.config import Settings, TelemetryConfig, TelemetryError, resolve
from telemetry.setup import describe

FILE = """
service_name: from-file
timeout_s: 3
headers: {a: file, b: file}
traces:
  exporter: console
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


def test_defaults_trace_and_push_nothing() -> None:
    s = settings()
    assert s.traces.exporter == "none" and s.metrics.exporter == "none"
    assert not s.tracing
    assert s.sampler == "parentbased_always_on" and s.sampler_arg is None
    assert s.service_name == "sluice-gateway"
    assert s.resource_attributes == {} and s.headers == {}
    assert (s.traces.protocol, s.traces.url) == ("http/protobuf",
                                                 "http://localhost:4318/v1/traces")
    assert (s.metrics.protocol, s.metrics.url) == ("http/protobuf",
                                                   "http://localhost:4318/v1/metrics")
    assert s.timeout_s == 10.0 and s.metrics_interval_s == 10.0 and s.schedule_delay_s == 1.0
    assert (s.max_queue_size, s.max_batch_size, s.max_label_values) == (8192, 512, 100)


def test_yaml_model_alone() -> None:
    s = settings(cfg=from_yaml())
    assert s.service_name == "from-file"
    assert s.traces.exporter == "console" and s.tracing
    assert s.traces.url == "http://file-collector:4318/v1/traces"
    assert s.sampler == "always_on"
    assert s.metrics.exporter == "otlp"
    assert s.metrics.url == "http://file-collector:4318/v1/metrics"
    assert s.metrics_interval_s == 5.0 and s.timeout_s == 3.0
    assert s.headers == {"a": "file", "b": "file"}
    assert s.max_label_values == 7


def test_environment_wins_over_the_yaml_model() -> None:
    s = settings(cfg=from_yaml(), env={
        "OTEL_SERVICE_NAME": "from-env",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_TRACES_SAMPLER": "TraceIdRatio",  # case-insensitive
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://env-collector:4318",
        "OTEL_EXPORTER_OTLP_HEADERS": "b=env,c=env",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "2500",
        "OTEL_METRIC_EXPORT_INTERVAL": "200",
        "OTEL_BSP_SCHEDULE_DELAY": "250",
        "OTEL_BSP_MAX_QUEUE_SIZE": "100",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "10",
    })
    assert s.service_name == "from-env"
    assert s.traces.exporter == "otlp" and s.metrics.exporter == "none"
    assert s.traces.url == "http://env-collector:4318/v1/traces"
    assert s.sampler == "traceidratio" and s.sampler_arg == 0.25
    assert s.headers == {"a": "file", "b": "env", "c": "env"}  # merged, env wins per key
    assert s.timeout_s == 2.5
    assert s.metrics_interval_s == 0.2
    assert s.schedule_delay_s == 0.25
    assert (s.max_queue_size, s.max_batch_size) == (100, 10)


@pytest.mark.parametrize("value", ["true", "TRUE", " True "])
def test_sdk_disabled_turns_everything_off(value: str) -> None:
    cfg = TelemetryConfig.model_validate({"traces": {"exporter": "otlp"},
                                          "metrics": {"exporter": "otlp"}})
    s = settings(cfg=cfg, env={"OTEL_SDK_DISABLED": value, "OTEL_TRACES_EXPORTER": "otlp",
                               "OTEL_METRICS_EXPORTER": "otlp"})
    assert s.traces.exporter == "none" and s.metrics.exporter == "none"
    assert not s.tracing
    tel = Telemetry.create("svc", cfg, env={"OTEL_SDK_DISABLED": value})
    assert not tel.tracing and tel.spans is None and tel.pusher is None
    assert not tel.tracer.start_span("x").is_recording()
    # "false" (or anything else) leaves the file's settings alone
    on = settings(cfg=cfg, env={"OTEL_SDK_DISABLED": "false"})
    assert on.traces.exporter == "otlp" and on.metrics.exporter == "otlp"


def test_always_off_sampler_means_no_tracing() -> None:
    s = settings(env={"OTEL_TRACES_EXPORTER": "otlp", "OTEL_TRACES_SAMPLER": "always_off"})
    assert not s.tracing


def test_console_metrics_exporter_means_no_push() -> None:
    assert settings(env={"OTEL_METRICS_EXPORTER": "console"}).metrics.exporter == "none"


# ---- endpoints ---------------------------------------------------------------------------

def test_general_endpoint_gets_the_signal_path_appended() -> None:
    s = settings(env={"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp",
                      "OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4318/base/"})
    assert s.traces.url == "https://collector:4318/base/v1/traces"
    assert s.metrics.url == "https://collector:4318/base/v1/metrics"


def test_per_signal_endpoint_is_used_as_is() -> None:
    s = settings(env={"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp",
                      "OTEL_EXPORTER_OTLP_ENDPOINT": "http://general:4318",
                      "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:9999/custom/path",
                      "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://metrics:9998"})
    assert s.traces.url == "http://traces:9999/custom/path"
    assert s.metrics.url == "http://metrics:9998"


def test_per_signal_endpoint_beats_the_file() -> None:
    s = settings(cfg=from_yaml(),
                 env={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:1/x"})
    assert s.traces.url == "http://traces:1/x"
    assert s.metrics.url == "http://file-collector:4318/v1/metrics"


def test_grpc_defaults_and_takes_no_path() -> None:
    s = settings(env={"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp",
                      "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert (s.traces.protocol, s.traces.url) == ("grpc", "http://localhost:4317")
    assert (s.metrics.protocol, s.metrics.url) == ("grpc", "http://localhost:4317")
    s = settings(env={"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                      "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"})
    assert s.traces.url == "http://collector:4317"


def test_per_signal_protocol_overrides_the_general_one() -> None:
    s = settings(env={"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp",
                      "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                      "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})
    assert (s.traces.protocol, s.traces.url) == ("http/protobuf",
                                                 "http://localhost:4318/v1/traces")
    assert (s.metrics.protocol, s.metrics.url) == ("grpc", "http://localhost:4317")
    # and over the file's protocol
    cfg = TelemetryConfig.model_validate({"metrics": {"protocol": "grpc"}})
    s = settings(cfg=cfg, env={"OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf"})
    assert s.metrics.protocol == "http/protobuf"
    assert settings(cfg=cfg).metrics.protocol == "grpc"


# ---- headers, resource, service name, timeout ---------------------------------------------

def test_headers_are_parsed_and_percent_decoded() -> None:
    s = settings(env={"OTEL_EXPORTER_OTLP_HEADERS":
                      "api-key=abc%20def, x-scope = a%3Db%2Cc ,,authorization=Bearer%20t0k"})
    assert s.headers == {"api-key": "abc def", "x-scope": "a=b,c",
                         "authorization": "Bearer t0k"}


def test_resource_attributes_are_parsed() -> None:
    s = settings(env={"OTEL_RESOURCE_ATTRIBUTES":
                      "deployment.environment=prod,team=a%20b,region=eu-west-1"})
    assert s.resource_attributes == {"deployment.environment": "prod", "team": "a b",
                                     "region": "eu-west-1"}
    tel = Telemetry.create("sluice-gateway", env={
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod"})
    assert tel.resource["deployment.environment"] == "prod"
    assert tel.resource["service.name"] == "sluice-gateway"


def test_service_name_precedence() -> None:
    file = TelemetryConfig(service_name="file-svc")
    res = {"OTEL_RESOURCE_ATTRIBUTES": "service.name=res-svc,k=v"}
    both = {**res, "OTEL_SERVICE_NAME": "env-svc"}
    assert settings().service_name == "sluice-gateway"
    assert settings(service="sluice-backend").service_name == "sluice-backend"
    assert settings(cfg=file).service_name == "file-svc"
    assert settings(env=res).service_name == "res-svc"
    assert settings(env=res, cfg=file).service_name == "res-svc"  # the environment wins
    assert settings(env=both, cfg=file).service_name == "env-svc"
    assert settings(env={"OTEL_SERVICE_NAME": "env-svc"}, cfg=file).service_name == "env-svc"
    # the resource the process reports carries the resolved name, not the attribute's
    tel = Telemetry.create("sluice-gateway", file, env=both)
    assert tel.resource["service.name"] == "env-svc" and tel.resource["k"] == "v"


def test_timeout_is_in_milliseconds() -> None:
    assert settings(env={"OTEL_EXPORTER_OTLP_TIMEOUT": "250"}).timeout_s == 0.25
    assert settings(env={"OTEL_EXPORTER_OTLP_TIMEOUT": "30000"}).timeout_s == 30.0
    assert settings(cfg=TelemetryConfig(timeout_s=4)).timeout_s == 4.0


# ---- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("env", "message"), [
    ({"OTEL_TRACES_EXPORTER": "jaeger"},
     r"OTEL_TRACES_EXPORTER='jaeger': supported exporters are otlp, console, none"),
    ({"OTEL_METRICS_EXPORTER": "zipkin"},
     r"OTEL_METRICS_EXPORTER='zipkin': supported exporters are otlp, console, none"),
    ({"OTEL_TRACES_SAMPLER": "jaeger_remote"},
     r"sampler 'jaeger_remote': supported are always_on, always_off, traceidratio"),
    ({"OTEL_TRACES_SAMPLER_ARG": "1.5"}, r"OTEL_TRACES_SAMPLER_ARG=1.5 must lie in \[0, 1\]"),
    ({"OTEL_TRACES_SAMPLER_ARG": "-0.1"}, r"OTEL_TRACES_SAMPLER_ARG=-0.1 must lie in \[0, 1\]"),
    ({"OTEL_TRACES_SAMPLER_ARG": "half"}, r"OTEL_TRACES_SAMPLER_ARG='half' is not a number"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
     r"OTLP protocol 'http/json': supported are http/protobuf and grpc"),
    ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "thrift"}, r"OTLP protocol 'thrift'"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"},
     r"OTLP endpoint 'collector:4318/v1/traces' must start with http:// or https://"),
    ({"OTEL_TRACES_EXPORTER": "otlp",
      "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "grpc://collector:4317"},
     r"OTLP endpoint 'grpc://collector:4317' must start with http:// or https://"),
    ({"OTEL_METRICS_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
      "OTEL_EXPORTER_OTLP_ENDPOINT": "localhost:4317"},
     r"OTLP endpoint 'localhost:4317' must start with http:// or https://"),
    ({"OTEL_EXPORTER_OTLP_HEADERS": "api-key"},
     r"OTEL_EXPORTER_OTLP_HEADERS: expected key=value pairs, got 'api-key'"),
    ({"OTEL_EXPORTER_OTLP_HEADERS": "a=1,=2"},
     r"OTEL_EXPORTER_OTLP_HEADERS: expected key=value pairs, got '=2'"),
    ({"OTEL_RESOURCE_ATTRIBUTES": "k=v,broken"},
     r"OTEL_RESOURCE_ATTRIBUTES: expected key=value pairs, got 'broken'"),
    ({"OTEL_EXPORTER_OTLP_TIMEOUT": "10s"}, r"OTEL_EXPORTER_OTLP_TIMEOUT='10s' is not a number"),
    ({"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "0"}, r"OTEL_BSP_MAX_EXPORT_BATCH_SIZE must be >= 1"),
    ({"OTEL_BSP_MAX_QUEUE_SIZE": "10", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "20"},
     r"<= OTEL_BSP_MAX_QUEUE_SIZE"),
])
def test_bad_settings_raise_clear_errors(env: dict[str, str], message: str) -> None:
    with pytest.raises(TelemetryError, match=message):
        settings(env=env)


def test_telemetry_error_is_a_value_error_and_create_raises_it() -> None:
    assert issubclass(TelemetryError, ValueError)
    with pytest.raises(TelemetryError, match="jaeger"):
        Telemetry.create("svc", env={"OTEL_TRACES_EXPORTER": "jaeger"})


def test_unknown_sampler_in_the_file_is_an_error_too() -> None:
    cfg = TelemetryConfig.model_validate({"traces": {"sampler": "sometimes"}})
    with pytest.raises(TelemetryError, match="sampler 'sometimes'"):
        settings(cfg=cfg)


def test_bad_endpoint_in_the_file_is_an_error_when_used() -> None:
    cfg = TelemetryConfig.model_validate({"traces": {"exporter": "otlp",
                                                     "endpoint": "collector:4318"}})
    with pytest.raises(TelemetryError, match="must start with http:// or https://"):
        settings(cfg=cfg)


# ---- the gateway's config file ----------------------------------------------------------

MODELS = [{"name": "m", "upstream": "http://x"}]


def test_gateway_config_accepts_a_telemetry_section() -> None:
    cfg = GatewayConfig.model_validate({"models": MODELS, "telemetry": {
        "service_name": "gw",
        "headers": {"authorization": "Bearer t"},
        "traces": {"exporter": "otlp", "endpoint": "http://c:4318", "protocol": "grpc",
                   "sampler": "parentbased_traceidratio", "sampler_arg": 0.1},
        "metrics": {"exporter": "otlp", "interval_s": 30, "max_label_values": 20},
    }})
    t = cfg.telemetry
    assert t.service_name == "gw" and t.headers == {"authorization": "Bearer t"}
    assert (t.traces.exporter, t.traces.protocol, t.traces.sampler_arg) == ("otlp", "grpc",
                                                                           0.1)
    assert (t.metrics.interval_s, t.metrics.max_label_values) == (30, 20)
    s = resolve(t, "sluice-gateway", {})
    assert s.traces.url == "http://c:4318" and s.sampler == "parentbased_traceidratio"
    # absent: the defaults
    assert GatewayConfig.model_validate({"models": MODELS}).telemetry == TelemetryConfig()


@pytest.mark.parametrize("section", [
    {"tracing": {"exporter": "otlp"}},
    {"traces": {"exporterr": "otlp"}},
    {"metrics": {"exporter": "otlp", "port": 9090}},
    {"traces": {"exporter": "jaeger"}},
    {"traces": {"protocol": "http/json"}},
    {"traces": {"sampler_arg": 1.5}},
    {"metrics": {"max_label_values": 0}},
    {"timeout_s": 0},
])
def test_gateway_config_rejects_bad_telemetry_keys(section: dict) -> None:
    with pytest.raises(pydantic.ValidationError) as err:
        GatewayConfig.model_validate({"models": MODELS, "telemetry": section})
    assert any(e["loc"][0] == "telemetry" for e in err.value.errors())


# ---- the start-up log line -------------------------------------------------------------------

def test_the_start_up_line_names_what_is_used(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sluice.telemetry")
    tel = Telemetry.create("sluice-gateway", env={"OTEL_TRACES_EXPORTER": "console"})
    tel.shutdown(1.0)
    line = next(r.getMessage() for r in caplog.records if r.name == "sluice.telemetry")
    # console writes spans to stdout: no OTLP endpoint is used, so none is named
    assert line == ("telemetry: service sluice-gateway, traces to stdout (console, sampler "
                    "parentbased_always_on), OTLP metrics off")


@pytest.mark.parametrize(("env", "said"), [
    ({}, "traces off, OTLP metrics off"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_TRACES_SAMPLER": "always_off"},
     "traces off (sampler always_off), OTLP metrics off"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"},
     ("traces to http://c:4318/v1/traces (OTLP http/protobuf, sampler parentbased_always_on), "
      "OTLP metrics off")),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
      "OTEL_METRICS_EXPORTER": "otlp", "OTEL_METRIC_EXPORT_INTERVAL": "5000"},
     ("traces to http://localhost:4317 (OTLP grpc, sampler parentbased_always_on), "
      "OTLP metrics to http://localhost:4317 (grpc, every 5 s)")),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_METRICS_EXPORTER": "otlp"},
     ("traces to stdout (console, sampler parentbased_always_on), "
      "OTLP metrics to http://localhost:4318/v1/metrics (http/protobuf, every 10 s)")),
])
def test_the_start_up_line_for_each_exporter(env: dict[str, str], said: str) -> None:
    assert describe(settings(env=env)) == f"service sluice-gateway, {said}"
