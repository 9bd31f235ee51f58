"""The gateway's traces and metrics, in-process in front of a scriptable upstream, exported
over real OTLP/HTTP to the test receiver."""

from __future__ import annotations

import importlib
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import (
    Capacity,
    Caps,
    GatewayConfig,
    PriorityRange,
    QuotasConfig,
    TenantEntry,
    TenantsFile,
)
from gateway.tenants import hash_key
from telemetry.bench.otlp_sink import OtlpReceiver, ReceivedEvent, ReceivedSpan
from telemetry.config import TelemetryConfig, TracesConfig
from tests.gateway.conftest import TEST_KEY, ThreadedGateway, auth, config_for
from tests.gateway.fake_backend import FakeBackend

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
# The request span's children when the request did not wait in the queue (a request that
# got a slot at once has no sluice.queue.wait span): the phases that wait on something.
SPANS = {"sluice.admission.reserve", "sluice.upstream"}
SPANS_PER_REQUEST = 1 + len(SPANS)  # and the request span itself
# the instant steps, events on the request span, in the order they happen
AUTH, RELAY, SETTLE = "sluice.auth", "sluice.relay", "sluice.settle"
STEPS = (AUTH, RELAY, SETTLE)
SERVER, CLIENT = 2, 3  # proto SpanKind values


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
    """The request spans (named ``chat m``): the SERVER spans that carry a request id."""
    return [s for s in spans if s.kind == SERVER and "sluice.request.id" in s.attributes]


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


def steps(root: ReceivedSpan) -> dict[str, ReceivedEvent]:
    """The request span's step events (auth, relay, settle), checked to be in that order,
    each once, and inside the span's time; by name."""
    mine = [e for e in root.events if e.name in STEPS]
    names = [e.name for e in mine]
    assert names == [n for n in STEPS if n in names], names  # in order, none twice
    times = [e.time_ns for e in mine]
    assert times == sorted(times), names
    assert all(root.start_ns <= t <= root.end_ns for t in times), names
    return {e.name: e for e in mine}


def spans_total(g: ThreadedGateway, result: str) -> float:
    """``sluice_telemetry_spans_total{result=...}`` as the gateway's /metrics reports it."""
    text = httpx.get(g.url + "/metrics", timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "sluice_telemetry_spans_total" and s.labels.get("result") == result)


def test_a_streamed_request_is_one_trace_with_its_phases(
        gw: ThreadedGateway, fake: FakeBackend, receiver: OtlpReceiver) -> None:
    headers = {**auth(), "x-request-id": "trace-me",
               "traceparent": f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"}
    body = {**CHAT, "stream": True, "max_tokens": 20, "temperature": 0.5, "seed": 7, "n": 1,
            "stop": "THE END", "presence_penalty": 0.25,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, headers=headers,
                      timeout=30) as resp:
        assert resp.status_code == 200
        events = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith("data: {")]
    usage = events[-1]["usage"]
    reasons = [c["choices"][0]["finish_reason"] for c in events if c["choices"]]
    root, children = request_tree(receiver, "trace-me", SPANS)

    # the client's trace continues: same trace id, the client's span is the parent
    assert root.trace_id == PARENT_TRACE and root.parent_span_id == PARENT_SPAN
    assert root.kind == SERVER
    # GenAI semantic conventions: "{gen_ai.operation.name} {gen_ai.request.model}"
    assert root.name == "chat m"
    assert all(c.trace_id == PARENT_TRACE for c in children.values())
    a = root.attributes
    assert a["sluice.tenant.id"] == "one" and a["sluice.priority"] == 4
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "sluice"
    assert a["gen_ai.request.model"] == "m" and a["gen_ai.response.model"] == "m"
    assert a["gen_ai.request.max_tokens"] == 20 and a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.request.stream"] is True and "sluice.stream" not in a
    assert a["gen_ai.request.seed"] == 7 and a["gen_ai.request.choice.count"] == 1
    assert a["gen_ai.request.stop_sequences"] == ["THE END"]
    assert a["gen_ai.request.presence_penalty"] == 0.25
    assert "gen_ai.request.frequency_penalty" not in a  # only what the body set
    assert a["gen_ai.response.time_to_first_chunk"] > 0
    assert a["gen_ai.response.time_to_first_chunk"] == pytest.approx(
        a["sluice.ttft_ms"] / 1000, abs=1e-3)
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == fake.chunks
    assert a["gen_ai.response.finish_reasons"] == [reasons[-1]] and reasons[-1]
    assert a["sluice.model.revision"] == fake.revision
    assert a["http.response.status_code"] == 200 and a["sluice.outcome"] == "success"
    for key in ("sluice.tokenizer", "sluice.chat_template", "sluice.engine", "sluice.policy"):
        assert key in a, key
    # it got a slot at once: 0 ms in the queue, and no queue span
    assert a["sluice.queue_ms"] == 0
    assert set(children) == SPANS, set(children)
    # the chunk count is the request span's (the streamed events with choices)
    assert a["sluice.chunks"] == len(reasons) == fake.chunks
    assert "authorization" not in json.dumps(a).lower() and TEST_KEY not in json.dumps(a)
    # the resource is the SDK's, with Sluice's service attributes
    res = root.resource
    assert res["service.name"] == "sluice-gateway"
    assert res["telemetry.sdk.name"] == "opentelemetry"
    assert res["telemetry.sdk.language"] == "python"
    assert res["service.version"] and res["service.instance.id"]
    assert all(c.resource == res for c in children.values())
    assert root.scope == "sluice.gateway"

    first = [e for e in root.events if e.name == "gen_ai.first_token"]
    assert len(first) == 1 and first[0].attributes["sluice.ttft_ms"] > 0
    # the instant steps are events on the request span: auth, then the answer's start
    # (relay), the first token, and settling, in that order and inside the span
    assert [e.name for e in root.events] == [AUTH, RELAY, "gen_ai.first_token", SETTLE]
    marks = steps(root)
    assert marks[AUTH].attributes == {"sluice.tenant.id": "one"}
    assert marks[RELAY].attributes == {}
    assert marks[SETTLE].attributes == {"gen_ai.usage.input_tokens": usage["prompt_tokens"],
                                         "gen_ai.usage.output_tokens": fake.chunks}
    # phase spans in order, inside the root
    reserve, upstream = children["sluice.admission.reserve"], children["sluice.upstream"]
    assert marks[AUTH].time_ns <= reserve.start_ns <= reserve.end_ns <= upstream.start_ns
    for c in children.values():
        assert root.start_ns <= c.start_ns <= c.end_ns <= root.end_ns
    assert upstream.kind == CLIENT
    # the answer starts while the upstream call runs; settling comes after it
    assert upstream.start_ns <= marks[RELAY].time_ns <= upstream.end_ns
    assert upstream.end_ns <= marks[SETTLE].time_ns
    assert reserve.attributes["sluice.granted"] is True

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
    root, children = request_tree(receiver, f"r{i}", {"sluice.admission.reserve"})
    a = root.attributes
    assert root.name == "chat m"  # the model was resolved before admission refused it
    assert a["http.response.status_code"] == 429 and a["sluice.outcome"] == "rejected_429"
    assert a["sluice.reject.reason"] == "requests_per_minute"
    assert a["sluice.retry_after_s"] > 0
    if retry is not None:
        assert a["sluice.retry_after_s"] <= retry
    assert children["sluice.admission.reserve"].attributes["sluice.granted"] is False
    assert set(children) == {"sluice.admission.reserve"}  # never queued nor dispatched
    # authenticated, but nothing was relayed and nothing held to settle
    assert list(steps(root)) == [AUTH]
    assert steps(root)[AUTH].attributes == {"sluice.tenant.id": "one"}


def test_a_request_refused_before_its_model_is_known_is_named_by_operation(
        gw: ThreadedGateway, receiver: OtlpReceiver) -> None:
    r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30,
                   headers={"authorization": "Bearer sk-nobody", "x-request-id": "no-auth"})
    assert r.status_code == 401
    root, children = request_tree(receiver, "no-auth", set())
    assert root.name == "chat"  # no model accepted: the operation alone
    a = root.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "sluice"
    assert "gen_ai.request.model" not in a and "sluice.tenant.id" not in a
    assert a["http.response.status_code"] == 401
    assert children == {}  # refused at auth: no phase span at all
    assert [e.name for e in root.events] == [AUTH]
    auth_event = steps(root)[AUTH]
    assert "error.type" in auth_event.attributes
    assert "sluice.tenant.id" not in auth_event.attributes


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
    root, children = request_tree(receiver, "leaver", {"sluice.upstream"})
    fake.release.set()
    assert root.attributes["sluice.outcome"] == "cancelled"
    assert root.attributes["http.response.status_code"] == 200  # the stream had begun
    assert set(children) == SPANS
    marks = steps(root)
    assert list(marks) == [AUTH, RELAY, SETTLE]
    # settled at what was generated before the client left (running usage), not zero
    assert marks[SETTLE].attributes["gen_ai.usage.output_tokens"] >= 1
    assert any(e.name == "gen_ai.first_token" for e in root.events)


def queue_length(g: ThreadedGateway) -> float:
    """``sluice_gateway_queue_length{model="m"}`` as the gateway's /metrics reports it."""
    text = httpx.get(g.url + "/metrics", timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "sluice_gateway_queue_length" and s.labels.get("model") == "m")


def test_only_a_request_that_waited_has_a_queue_span(
        fake: FakeBackend, receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch) -> None:
    """The upstream runs one sequence at a time (max_seqs=1). The first request gets the
    slot at once (no queue span, ``sluice.queue_ms`` 0) and holds it while its stream is
    held; the second waits in the queue until the first ends, and its trace has a
    ``sluice.queue.wait`` span between its reservation and its upstream call."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    fake.mode = "hold"  # a stream sends two chunks, then waits for fake.release
    cfg = config_for(fake.url, kind="openai", tokenizer="bytes",
                     capacity=Capacity(max_seqs=1))
    with ThreadedGateway(traced(cfg, receiver.endpoint), tenants()) as g, \
            ThreadPoolExecutor(1) as pool:
        with httpx.stream("POST", g.url + "/v1/chat/completions",
                          json={**CHAT, "stream": True}, timeout=30,
                          headers={**auth(), "x-request-id": "holder"}) as held:
            assert held.status_code == 200
            assert held.headers["x-sluice-queue-ms"] == "0"
            lines = held.iter_lines()
            while not next(lines).startswith("data: "):
                pass  # the holder is streaming: it has the only slot
            # not streamed, so the fake answers it at once when it gets there
            waiter = pool.submit(httpx.post, g.url + "/v1/chat/completions", json=CHAT,
                                 timeout=30, headers={**auth(), "x-request-id": "waiter"})
            deadline = time.monotonic() + 15
            while queue_length(g) < 1:
                assert not waiter.done(), waiter.result().text  # it must wait, not pass
                assert time.monotonic() < deadline, "the second request never queued"
                time.sleep(0.02)
            assert not fake.served[1:]  # still queued: the upstream has not seen it
            fake.release.set()  # the holder's stream ends: its slot goes to the waiter
            assert [line for line in lines if line][-1] == "data: [DONE]"
        resp = waiter.result(timeout=30)
    assert resp.status_code == 200 and resp.json()["choices"]
    waited_ms = int(resp.headers["x-sluice-queue-ms"])
    assert waited_ms > 0

    root, children = request_tree(receiver, "holder", SPANS)
    assert set(children) == SPANS  # got its slot at once: no queue span
    assert root.attributes["sluice.queue_ms"] == 0

    root, children = request_tree(receiver, "waiter", SPANS | {"sluice.queue.wait"})
    assert set(children) == SPANS | {"sluice.queue.wait"}
    queue = children["sluice.queue.wait"]
    assert queue.kind == 1  # INTERNAL
    assert queue.attributes["sluice.queue_ms"] == root.attributes["sluice.queue_ms"] \
        == waited_ms
    assert queue.attributes["sluice.queue.length"] == 0  # nobody waited ahead of it
    reserve, upstream = children["sluice.admission.reserve"], children["sluice.upstream"]
    # reserved, then waited, then called the upstream; all inside the request span
    assert root.start_ns <= reserve.start_ns <= reserve.end_ns <= queue.start_ns
    assert queue.start_ns < queue.end_ns <= upstream.start_ns <= upstream.end_ns <= root.end_ns
    assert list(steps(root)) == [AUTH, RELAY, SETTLE]
    assert queue.end_ns <= steps(root)[RELAY].time_ns  # the answer began after the wait


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
            root, children = request_tree(rx, "over-grpc", SPANS)  # type: ignore[arg-type]
            assert root.resource["service.name"] == "sluice-gateway"
            assert set(children) == SPANS
            assert list(steps(root)) == [AUTH, RELAY, SETTLE]  # events survive gRPC too

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
    # seconds: the SDK's exporters retry a refused connection with backoff until then
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "2")
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = config_for(fake.url).model_copy(update={"telemetry": TelemetryConfig(
        traces=TracesConfig(exporter="otlp", endpoint=dead, protocol=protocol))})
    with ThreadedGateway(cfg, tenants()) as g:
        for stream in (True, False, True):
            r = httpx.post(g.url + "/v1/chat/completions", json={**CHAT, "stream": stream},
                           headers=auth(), timeout=30)
            assert r.status_code == 200
        tel = g.gateway.telemetry
        # a request's spans end just after its answer; none of the three queued
        expected = 3 * SPANS_PER_REQUEST
        deadline = time.monotonic() + 30
        while tel.span_counts()[1] < expected and time.monotonic() < deadline:
            tel.force_flush(1)
        assert tel.span_counts()[:2] == (0, expected)  # none exported, all failed
        assert spans_total(g, "export_failed") == expected  # and /metrics says so


class Batches:
    """How many batches the SDK's OTLP span exporter finished (each may take several
    export requests: the exporter retries a 503 or UNAVAILABLE with backoff)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, protocol: str) -> None:
        kind = "grpc" if protocol == "grpc" else "http"
        cls = importlib.import_module(
            f"opentelemetry.exporter.otlp.proto.{kind}.trace_exporter").OTLPSpanExporter
        self.done = 0
        self._lock = threading.Lock()
        inner = cls.export

        def export(exporter: Any, spans: Any) -> Any:
            try:
                return inner(exporter, spans)
            finally:
                with self._lock:
                    self.done += 1

        monkeypatch.setattr(cls, "export", export)


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_a_failing_collector_loses_no_request_and_is_retried(
        fake: FakeBackend, protocol: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A collector answering 503 (over gRPC: UNAVAILABLE): the SDK's exporter retries each
    batch with backoff on its own thread until OTEL_EXPORTER_OTLP_TIMEOUT, then gives up
    and the spans count as export_failed; no request waits for it or fails. Once the
    collector is back, spans arrive again."""
    from telemetry.bench.otlp_sink import OtlpGrpcReceiver

    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "2")  # seconds: the retries stop soon
    batches = Batches(monkeypatch, protocol)
    with (OtlpGrpcReceiver() if protocol == "grpc" else OtlpReceiver()) as rx:
        rx.status = 503  # refused requests are still counted in rx.requests
        cfg = config_for(fake.url).model_copy(update={"telemetry": TelemetryConfig(
            traces=TracesConfig(exporter="otlp", endpoint=rx.endpoint, protocol=protocol))})
        with ThreadedGateway(cfg, tenants()) as g:
            for i, stream in enumerate((True, False, True)):
                r = httpx.post(g.url + "/v1/chat/completions",
                               json={**CHAT, "stream": stream}, timeout=30,
                               headers={**auth(), "x-request-id": f"refused-{i}"})
                assert r.status_code == 200
                if stream:
                    assert r.text.rstrip().endswith("data: [DONE]")
                else:
                    assert r.json()["choices"]
            # every span of the three requests ends as export_failed, none is exported
            # (none of them queued: the request, reserve and upstream spans each)
            expected = 3 * SPANS_PER_REQUEST
            deadline = time.monotonic() + 60
            while spans_total(g, "export_failed") < expected:
                assert time.monotonic() < deadline, "the failed exports were not counted"
                time.sleep(0.1)
            assert spans_total(g, "export_failed") == expected
            assert spans_total(g, "exported") == 0 and rx.spans() == []
            # all batches are done (each counted before its spans were): each was sent, and
            # at least one was sent again after a backoff
            assert rx.requests > batches.done >= 1

            rx.status = 200  # the collector is back: the next request's spans arrive
            r = httpx.post(g.url + "/v1/chat/completions", json=CHAT, timeout=30,
                           headers={**auth(), "x-request-id": "after-recovery"})
            assert r.status_code == 200
            root, children = request_tree(rx, "after-recovery", SPANS)  # type: ignore[arg-type]
            assert root.name == "chat m" and set(children) == SPANS
            assert spans_total(g, "export_failed") == expected


def test_the_exporter_is_configured_by_the_standard_environment_alone(
        fake: FakeBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """No telemetry section in the file: OTEL_TRACES_EXPORTER, OTEL_EXPORTER_OTLP_ENDPOINT
    and OTEL_EXPORTER_OTLP_PROTOCOL choose the exporter; the resource takes
    OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES."""
    from telemetry.bench.otlp_sink import OtlpGrpcReceiver

    with OtlpGrpcReceiver() as rx:
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "edge-gateway")
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment.name=test")
        for name in ("OTEL_SDK_DISABLED", "OTEL_TRACES_SAMPLER",
                     "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
            monkeypatch.delenv(name, raising=False)
        cfg = config_for(fake.url)
        assert "telemetry" not in cfg.model_fields_set  # only the environment says where
        with ThreadedGateway(cfg, tenants()) as g:
            r = httpx.post(g.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 8},
                           headers={**auth(), "x-request-id": "by-env"}, timeout=30)
            assert r.status_code == 200
            root, children = request_tree(rx, "by-env", SPANS)  # type: ignore[arg-type]
    assert root.name == "chat m" and set(children) == SPANS
    assert list(steps(root)) == [AUTH, RELAY, SETTLE]
    a = root.attributes
    assert a["gen_ai.request.max_tokens"] == 8 and a["gen_ai.request.stream"] is False
    res = root.resource
    assert res["service.name"] == "edge-gateway"
    assert res["deployment.environment.name"] == "test"
    assert (res["telemetry.sdk.name"], res["telemetry.sdk.language"]) == ("opentelemetry",
                                                                          "python")
    assert res["service.version"] and res["service.instance.id"]


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
        # propagated, sampled flag (bit 0) clear; the SDK may set W3C level 2's random bit
        assert int(sent.rsplit("-", 1)[1], 16) & 1 == 0
        # a client's sampled trace is followed (parent-based), and recorded
        r = httpx.post(g.url + "/v1/chat/completions", json=CHAT, timeout=30,
                       headers={**auth(), "x-request-id": "followed",
                                "traceparent": f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"})
        assert r.status_code == 200
        assert fake.headers[-1]["traceparent"].startswith(f"00-{PARENT_TRACE}-")
        root, _ = request_tree(receiver, "followed", SPANS)
        assert root.trace_id == PARENT_TRACE
        assert g.gateway.telemetry.force_flush(5)
    assert not [s for s in receiver.spans()
                if s.attributes.get("sluice.request.id") == "unsampled"]
    assert sent.split("-")[1] != PARENT_TRACE
