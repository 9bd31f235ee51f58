"""The gateway's traces and metrics, in-process in front of a scriptable upstream, exported
over real OTLP/HTTP to the test receiver."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import (
    Caps,
    GatewayConfig,
    PriorityRange,
    QuotasConfig,
    TenantEntry,
    TenantsFile,
)
from gateway.tenants import hash_key
from telemetry.bench.otlp_sink import OtlpReceiver, ReceivedSpan
from telemetry.config import TelemetryConfig, TracesConfig
from tests.gateway.conftest import TEST_KEY, ThreadedGateway, auth, config_for
from tests.gateway.fake_backend import FakeBackend

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
PHASES = {"sluice.auth", "sluice.admission.reserve", "sluice.queue.wait", "sluice.upstream",
          "sluice.relay", "sluice.settle"}


def tenants() -> TenantsFile:
    return TenantsFile(tenants=[
        TenantEntry(id="one", keys=[hash_key(TEST_KEY)], models=["*"],
                    priority=PriorityRange(min=0, max=10, default=4), caps=Caps(max_tokens=50),
                    quotas=QuotasConfig(requests_per_minute=4)),
    ])


def traced(cfg: GatewayConfig, endpoint: str) -> GatewayConfig:
    return cfg.model_copy(update={"telemetry": TelemetryConfig(
        traces=TracesConfig(exporter="otlp", endpoint=endpoint))})


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as rx:
        yield rx


@pytest.fixture
def fake() -> Iterator[FakeBackend]:
    with FakeBackend() as f:
        yield f


@pytest.fixture
def gw(fake: FakeBackend, receiver: OtlpReceiver,
       monkeypatch: pytest.MonkeyPatch) -> Iterator[ThreadedGateway]:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    with ThreadedGateway(traced(config_for(fake.url), receiver.endpoint), tenants()) as g:
        yield g


def roots(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == "sluice.request"]


def request_tree(rx: OtlpReceiver, request_id: str, phases: set[str]) -> tuple[
        ReceivedSpan, dict[str, ReceivedSpan]]:
    def ready(spans: list[ReceivedSpan]) -> bool:
        root = [s for s in roots(spans) if s.attributes.get("sluice.request.id") == request_id]
        return bool(root) and phases <= {s.name for s in spans
                                         if s.parent_span_id == root[0].span_id}

    spans = rx.wait_for(ready, timeout=15)
    root = next(s for s in roots(spans) if s.attributes["sluice.request.id"] == request_id)
    children = {s.name: s for s in spans if s.parent_span_id == root.span_id}
    return root, children


def test_a_streamed_request_is_one_trace_with_its_phases(
        gw: ThreadedGateway, fake: FakeBackend, receiver: OtlpReceiver) -> None:
    headers = {**auth(), "x-request-id": "trace-me",
               "traceparent": f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"}
    body = {**CHAT, "stream": True, "max_tokens": 20, "temperature": 0.5,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, headers=headers,
                      timeout=30) as resp:
        assert resp.status_code == 200
        events = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith("data: {")]
    usage = events[-1]["usage"]
    reasons = [c["choices"][0]["finish_reason"] for c in events if c["choices"]]
    root, children = request_tree(receiver, "trace-me", PHASES)

    # the client's trace continues: same trace id, the client's span is the parent
    assert root.trace_id == PARENT_TRACE and root.parent_span_id == PARENT_SPAN
    assert root.kind == 2  # SERVER
    assert all(c.trace_id == PARENT_TRACE for c in children.values())
    a = root.attributes
    assert a["sluice.tenant.id"] == "one" and a["sluice.priority"] == 4
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == "m" and a["gen_ai.response.model"] == "m"
    assert a["gen_ai.request.max_tokens"] == 20 and a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == fake.chunks
    assert a["gen_ai.response.finish_reasons"] == [reasons[-1]] and reasons[-1]
    assert a["sluice.model.revision"] == fake.revision
    assert a["http.response.status_code"] == 200 and a["sluice.outcome"] == "success"
    for key in ("sluice.tokenizer", "sluice.chat_template", "sluice.engine", "sluice.policy",
                "sluice.queue_ms"):
        assert key in a, key
    assert "authorization" not in json.dumps(a).lower() and TEST_KEY not in json.dumps(a)
    assert root.resource["service.name"] == "sluice-gateway"

    first = [e for e in root.events if e.name == "gen_ai.first_token"]
    assert len(first) == 1 and first[0].attributes["sluice.ttft_ms"] > 0
    # phases in order, inside the root
    order = ["sluice.auth", "sluice.admission.reserve", "sluice.queue.wait",
             "sluice.upstream"]
    starts = [children[n].start_ns for n in order]
    assert starts == sorted(starts)
    for c in children.values():
        assert root.start_ns <= c.start_ns <= c.end_ns <= root.end_ns
    assert children["sluice.upstream"].kind == 3  # CLIENT
    assert children["sluice.relay"].start_ns >= children["sluice.upstream"].start_ns
    assert children["sluice.admission.reserve"].attributes["sluice.granted"] is True
    assert children["sluice.settle"].attributes["gen_ai.usage.output_tokens"] == fake.chunks

    # the upstream got the trace: its parent is the gateway's upstream span
    sent = fake.headers[-1]
    assert sent["traceparent"] == (f"00-{PARENT_TRACE}-"
                                   f"{children['sluice.upstream'].span_id}-01")
    assert sent["x-sluice-tenant"] == "one"


def test_a_rejected_request_is_a_trace_with_reason_and_retry_after(
        gw: ThreadedGateway, receiver: OtlpReceiver) -> None:
    statuses = []
    for i in range(6):
        r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT,
                       headers={**auth(), "x-request-id": f"r{i}"}, timeout=30)
        statuses.append(r.status_code)
    assert statuses.count(429) >= 1
    i = statuses.index(429)
    retry = float(r.headers["retry-after"]) if statuses[-1] == 429 else None
    root, children = request_tree(receiver, f"r{i}", {"sluice.auth",
                                                      "sluice.admission.reserve"})
    a = root.attributes
    assert a["http.response.status_code"] == 429 and a["sluice.outcome"] == "rejected_429"
    assert a["sluice.reject.reason"] == "requests_per_minute"
    assert a["sluice.retry_after_s"] > 0
    if retry is not None:
        assert a["sluice.retry_after_s"] <= retry
    assert children["sluice.admission.reserve"].attributes["sluice.granted"] is False
    assert "sluice.upstream" not in children  # never dispatched


def test_a_cancelled_request_is_a_trace(gw: ThreadedGateway, fake: FakeBackend,
                                        receiver: OtlpReceiver) -> None:
    fake.mode = "hold"  # two chunks, then waits
    with httpx.stream("POST", gw.url + "/v1/chat/completions",
                      json={**CHAT, "stream": True},
                      headers={**auth(), "x-request-id": "leaver"}, timeout=30) as resp:
        lines = resp.iter_lines()
        while not next(lines).startswith("data: "):
            pass
    # the client closed mid-stream
    root, children = request_tree(receiver, "leaver", {"sluice.upstream", "sluice.settle"})
    fake.release.set()
    assert root.attributes["sluice.outcome"] == "cancelled"
    assert root.attributes["http.response.status_code"] == 200  # the stream had begun
    # settled at what was generated before the client left (running usage), not zero
    assert children["sluice.settle"].attributes["gen_ai.usage.output_tokens"] >= 1
    assert any(e.name == "gen_ai.first_token" for e in root.events)


def test_metrics_count_what_was_sent(gw: ThreadedGateway, fake: FakeBackend) -> None:
    ok = 3
    for _ in range(ok):
        r = httpx.post(gw.url + "/v1/chat/completions",
                       json={**CHAT, "stream": True}, headers=auth(), timeout=30)
        assert r.status_code == 200
    assert httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 999},
                      headers=auth(), timeout=30).status_code == 400
    rejected = sum(httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=auth(),
                              timeout=30).status_code == 429 for _ in range(3))
    assert rejected == 2  # requests_per_minute=4: one more success, then 429s
    text = httpx.get(gw.url + "/metrics", timeout=5).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}

    def value(family: str, sample: str, **labels: str) -> float:
        return sum(s.value for s in fams[family].samples if s.name == sample
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("sluice_gateway_requests", "sluice_gateway_requests_total",
                 tenant="one", model="m", outcome="success") == ok + 1
    assert value("sluice_gateway_requests", "sluice_gateway_requests_total",
                 outcome="rejected_429") == rejected
    assert value("sluice_gateway_requests", "sluice_gateway_requests_total",
                 outcome="invalid") == 1
    assert value("sluice_gateway_rejected", "sluice_gateway_rejected_total",
                 reason="requests_per_minute") == rejected
    assert value("sluice_gateway_output_tokens", "sluice_gateway_output_tokens_total",
                 tenant="one") == (ok + 1) * fake.chunks
    cls = {"tenant": "one", "model": "m", "priority_class": "p4-6"}
    assert value("sluice_gateway_ttft_seconds", "sluice_gateway_ttft_seconds_count",
                 **cls) == ok
    # every streamed answer has `chunks` tokens: chunks - 1 gaps each, and one TPOT
    assert value("sluice_gateway_itl_seconds", "sluice_gateway_itl_seconds_count",
                 **cls) == ok * (fake.chunks - 1)
    assert value("sluice_gateway_tpot_seconds", "sluice_gateway_tpot_seconds_count",
                 **cls) == ok
    assert value("sluice_gateway_e2e_seconds", "sluice_gateway_e2e_seconds_count",
                 **cls) == ok + 1
    assert value("sluice_gateway_queue_time_seconds",
                 "sluice_gateway_queue_time_seconds_count", **cls) == ok + 1
    assert value("sluice_gateway_store_up", "sluice_gateway_store_up") == 1
    assert value("sluice_telemetry_spans", "sluice_telemetry_spans_total",
                 result="dropped_queue_full") == 0



def test_traces_and_metrics_over_otlp_grpc(fake: FakeBackend,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from telemetry.bench.otlp_sink import OtlpGrpcReceiver
    from telemetry.config import MetricsConfig

    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    with OtlpGrpcReceiver() as rx:
        cfg = config_for(fake.url).model_copy(update={"telemetry": TelemetryConfig(
            traces=TracesConfig(exporter="otlp", endpoint=rx.endpoint, protocol="grpc"),
            metrics=MetricsConfig(exporter="otlp", endpoint=rx.endpoint, protocol="grpc",
                                  interval_s=0.1))})
        with ThreadedGateway(cfg, tenants()) as g:
            r = httpx.post(g.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                           headers={**auth(), "x-request-id": "over-grpc"}, timeout=30)
            assert r.status_code == 200
            root, children = request_tree(rx, "over-grpc", PHASES)  # type: ignore[arg-type]
            assert root.resource["service.name"] == "sluice-gateway"
            assert set(children) == PHASES

            def counted(metrics: list[Any]) -> bool:
                return any(m.name == "sluice_gateway_requests" and any(
                    p["attributes"].get("outcome") == "success" and p["value"] == 1
                    for p in m.points) for m in metrics)

            rx.wait_for_metrics(counted, timeout=15)


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_a_dead_collector_never_fails_a_request(fake: FakeBackend, protocol: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.backend.server.conftest import free_port

    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "300")
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = config_for(fake.url).model_copy(update={"telemetry": TelemetryConfig(
        traces=TracesConfig(exporter="otlp", endpoint=dead, protocol=protocol))})
    with ThreadedGateway(cfg, tenants()) as g:
        for stream in (True, False, True):
            r = httpx.post(g.url + "/v1/chat/completions", json={**CHAT, "stream": stream},
                           headers=auth(), timeout=30)
            assert r.status_code == 200
        tel = g.gateway.telemetry
        expected = 3 * (1 + len(PHASES))  # a request's spans end just after its answer
        deadline = time.monotonic() + 15
        while tel.spans.failed < expected and time.monotonic() < deadline:
            tel.force_flush(1)
        assert tel.spans.failed == expected and tel.spans.exported == 0


def test_an_unsampled_request_records_nothing_but_passes_the_trace_on(
        fake: FakeBackend, receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")  # no new trace is ever sampled
    with ThreadedGateway(traced(config_for(fake.url), receiver.endpoint), tenants()) as g:
        r = httpx.post(g.url + "/v1/chat/completions", json=CHAT,
                       headers={**auth(), "x-request-id": "unsampled"}, timeout=30)
        assert r.status_code == 200
        sent = fake.headers[-1]["traceparent"]
        assert sent.endswith("-00")  # propagated, not sampled
        # a client's sampled trace is followed (parent-based), and recorded
        r = httpx.post(g.url + "/v1/chat/completions", json=CHAT, timeout=30,
                       headers={**auth(), "x-request-id": "followed",
                                "traceparent": f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"})
        assert r.status_code == 200
        assert fake.headers[-1]["traceparent"].startswith(f"00-{PARENT_TRACE}-")
        root, _ = request_tree(receiver, "followed", PHASES)
        assert root.trace_id == PARENT_TRACE
        assert g.gateway.telemetry.force_flush(5)
    assert not [s for s in receiver.spans()
                if s.attributes.get("sluice.request.id") == "unsampled"]
    assert sent.split("-")[1] != PARENT_TRACE
