"""One trace from the gateway to the engine: `sluice up` (gateway and bundled backend, two
processes) exporting over real OTLP/HTTP to the test receiver; and `sluice up` exporting
to a closed port, where every request must still succeed."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.tenants import hash_key
from modelfiles.tiny_model import ensure_tiny_model
from telemetry.bench.otlp_sink import OtlpReceiver, ReceivedEvent, ReceivedSpan
from tests.backend.server.conftest import free_port
from tests.gateway.conftest import SluiceUp, start_sluice_up

KEY, TIGHT_KEY = "sk-trace-open", "sk-trace-tight"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
# the gateway's phase spans for a request that did not wait in its queue (one that got a
# slot at once has no sluice.queue.wait span); auth, relay and settle are events on its
# request span, in that order
GATEWAY_SPANS = {"sluice.admission.reserve", "sluice.upstream"}
AUTH, RELAY, SETTLE = "sluice.auth", "sluice.relay", "sluice.settle"
STEPS = (AUTH, RELAY, SETTLE)
ENGINE_PHASES = {"engine.queue", "engine.prefill", "engine.decode"}
SERVER, CLIENT = 2, 3


def tenants_file(tmp: Path) -> Path:
    path = tmp / "tenants.yaml"
    path.write_text(
        "tenants:\n"
        f"  - id: open\n    keys: ['{hash_key(KEY)}']\n"
        f"  - id: tight\n    keys: ['{hash_key(TIGHT_KEY)}']\n"
        "    quotas: {requests_per_minute: 1}\n")
    return path


def up_with(tmp: Path, mp: pytest.MonkeyPatch, endpoint: str, **env: str) -> SluiceUp:
    mp.setenv("OTEL_TRACES_EXPORTER", "otlp")
    mp.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    for name in ("OTEL_SDK_DISABLED", "OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER",
                 "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_METRICS_EXPORTER",
                 "OTEL_RESOURCE_ATTRIBUTES", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        mp.delenv(name, raising=False)
    for name, value in env.items():
        mp.setenv(name, value)
    ensure_tiny_model()
    return start_sluice_up(tmp, "--tenants", str(tenants_file(tmp)))


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def up(receiver: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceUp]:
    with pytest.MonkeyPatch.context() as mp:
        u = up_with(tmp_path_factory.mktemp("traced-up"), mp, receiver.endpoint)
    yield u
    assert u.stop() == 0


def auth(key: str = KEY, **extra: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", **extra}


def request_span(spans: list[ReceivedSpan], scope: str,
                 request_id: str | None = None) -> ReceivedSpan | None:
    """The request span (SERVER, named ``chat sluice-tiny`` etc.) that ``scope``
    (``sluice.gateway`` or ``sluice.backend``) recorded, for ``request_id`` if given."""
    return next((s for s in spans if s.kind == SERVER and s.scope == scope
                 and "sluice.request.id" in s.attributes
                 and request_id in (None, s.attributes["sluice.request.id"])), None)


def steps(root: ReceivedSpan) -> dict[str, ReceivedEvent]:
    """The gateway request span's step events (auth, relay, settle), checked to be in that
    order, each once, and inside the span's time; by name."""
    mine = [e for e in root.events if e.name in STEPS]
    names = [e.name for e in mine]
    assert names == [n for n in STEPS if n in names], names
    times = [e.time_ns for e in mine]
    assert times == sorted(times), names
    assert all(root.start_ns <= t <= root.end_ns for t in times), names
    return {e.name: e for e in mine}


def trace_of(rx: OtlpReceiver, request_id: str, gateway: set[str],
             engine: set[str] | None) -> tuple[ReceivedSpan, ReceivedSpan | None,
                                                 list[ReceivedSpan]]:
    """The gateway's root, the engine's root (None when ``engine`` is None) and every span
    of their trace, once the named children of both have arrived."""
    def complete(spans: list[ReceivedSpan]) -> bool:
        root = request_span(spans, "sluice.gateway", request_id)
        if root is None:
            return False
        mine = [s for s in spans if s.trace_id == root.trace_id]
        if not gateway <= {s.name for s in mine if s.parent_span_id == root.span_id}:
            return False
        if engine is None:
            return True
        eng = request_span(mine, "sluice.backend")
        return eng is not None and engine <= {s.name for s in mine
                                              if s.parent_span_id == eng.span_id}

    spans = rx.wait_for(complete, timeout=20)
    root = request_span(spans, "sluice.gateway", request_id)
    assert root is not None
    mine = [s for s in spans if s.trace_id == root.trace_id]
    return root, request_span(mine, "sluice.backend"), mine


def test_a_streamed_request_is_one_trace_from_gateway_to_engine(
        up: SluiceUp, receiver: OtlpReceiver) -> None:
    headers = auth(**{"x-request-id": "one-trace",
                      "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    body = {"model": "sluice-tiny", "stream": True, "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": "tell me about the sea"}],
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", up.url + "/v1/chat/completions", json=body, headers=headers,
                      timeout=60) as resp:
        assert resp.status_code == 200
        events = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith("data: {")]
    usage = events[-1]["usage"]
    root, eng, spans = trace_of(receiver, "one-trace", GATEWAY_SPANS, ENGINE_PHASES)
    assert eng is not None

    # one trace: the client's, through the gateway, into the engine
    assert root.trace_id == eng.trace_id == CLIENT_TRACE
    assert root.parent_span_id == CLIENT_SPAN and root.kind == SERVER
    # both named as the GenAI semantic conventions say: "{operation} {model}"
    assert root.name == eng.name == "chat sluice-tiny"
    by_name = {s.name: s for s in spans}
    upstream = by_name["sluice.upstream"]
    assert upstream.parent_span_id == root.span_id and upstream.kind == CLIENT
    assert eng.parent_span_id == upstream.span_id and eng.kind == SERVER
    for name in GATEWAY_SPANS:
        assert by_name[name].parent_span_id == root.span_id, name
    # nothing else was in flight: the request got its slot at once, so no queue span
    assert {s.name for s in spans if s.parent_span_id == root.span_id} == GATEWAY_SPANS
    assert root.attributes["sluice.queue_ms"] == 0
    # auth, the answer's start, the first token and settling: events, in order
    assert [e.name for e in root.events] == [AUTH, RELAY, "gen_ai.first_token", SETTLE]
    marks = steps(root)
    assert marks[AUTH].attributes == {"sluice.tenant.id": "open"}
    assert upstream.start_ns <= marks[RELAY].time_ns <= upstream.end_ns
    assert marks[SETTLE].attributes == {
        "gen_ai.usage.input_tokens": usage["prompt_tokens"],
        "gen_ai.usage.output_tokens": usage["completion_tokens"]}
    for name in ENGINE_PHASES:
        assert by_name[name].parent_span_id == eng.span_id, name
    assert root.resource["service.name"] == "sluice-gateway"
    assert eng.resource["service.name"] == "sluice-backend"
    for res in (root.resource, eng.resource):  # the SDK's resource, in both processes
        assert res["telemetry.sdk.name"] == "opentelemetry"
        assert res["telemetry.sdk.language"] == "python"
        assert res["service.version"] and res["service.instance.id"]
    assert root.resource["service.version"] == eng.resource["service.version"]
    assert root.resource["service.instance.id"] != eng.resource["service.instance.id"]

    # time: the engine's work lies inside the gateway's upstream call
    assert upstream.start_ns <= eng.start_ns and eng.end_ns <= upstream.end_ns + 5_000_000
    queue, prefill, decode = (by_name[n] for n in ("engine.queue", "engine.prefill",
                                                    "engine.decode"))
    assert queue.end_ns <= prefill.end_ns <= decode.end_ns
    assert any(e.name == "engine.prefill.chunk" for e in prefill.events)
    assert any(e.name == "gen_ai.first_token" for e in root.events)

    # both ends agree on who, what and how much
    g, e = root.attributes, eng.attributes
    assert g["sluice.tenant.id"] == e["sluice.tenant.id"] == "open"
    assert g["gen_ai.operation.name"] == e["gen_ai.operation.name"] == "chat"
    assert g["gen_ai.provider.name"] == e["gen_ai.provider.name"] == "sluice"
    assert g["gen_ai.request.stream"] is e["gen_ai.request.stream"] is True
    assert g["gen_ai.request.max_tokens"] == e["gen_ai.request.max_tokens"] == 12
    assert g["gen_ai.request.model"] == "sluice-tiny"
    assert g["gen_ai.response.model"] == e["gen_ai.response.model"] == "sluice-tiny"
    for key in ("sluice.model.revision", "sluice.tokenizer", "sluice.chat_template"):
        assert g[key] == e[key], key
    assert g["gen_ai.usage.input_tokens"] == e["gen_ai.usage.input_tokens"] \
        == usage["prompt_tokens"]
    assert g["gen_ai.usage.output_tokens"] == e["gen_ai.usage.output_tokens"] \
        == usage["completion_tokens"]
    assert g["gen_ai.response.finish_reasons"] == e["gen_ai.response.finish_reasons"]
    assert g["sluice.priority"] == e["sluice.priority"]
    assert decode.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert g["sluice.ttft_ms"] >= e["sluice.ttft_ms"] > 0
    assert g["sluice.policy"] and g["sluice.outcome"] == "success"
    assert KEY not in json.dumps([s.attributes for s in spans])


def test_a_cancelled_request_is_traced_to_the_engine_abort(
        up: SluiceUp, receiver: OtlpReceiver) -> None:
    body = json.dumps({"model": "sluice-tiny", "stream": True, "max_tokens": 400,
                       "ignore_eos": True, "prompt": "once upon a time"}).encode()
    host, port = up.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                     b"authorization: Bearer " + KEY.encode() + b"\r\n"
                     b"x-request-id: leaves-early\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        seen = b""
        while seen.count(b"data: ") < 3:  # a few tokens in, then hang up
            chunk = sock.recv(65536)
            assert chunk, "the stream ended before the client left"
            seen += chunk
    root, eng, spans = trace_of(receiver, "leaves-early", {"sluice.upstream"},
                                {"engine.abort"})
    assert eng is not None
    assert root.name == eng.name == "text_completion sluice-tiny"
    assert root.attributes["sluice.outcome"] == "cancelled"
    # the answer had begun, and what it used was settled when the client left
    marks = steps(root)
    assert list(marks) == [AUTH, RELAY, SETTLE]
    assert 1 <= marks[SETTLE].attributes["gen_ai.usage.output_tokens"] < 400
    abort = next(s for s in spans if s.name == "engine.abort")
    assert abort.attributes["sluice.abort.reason"] == "client_disconnect"
    assert abort.attributes["gen_ai.usage.output_tokens"] < 400


def test_a_rejected_request_is_a_trace_with_its_reason(
        up: SluiceUp, receiver: OtlpReceiver) -> None:
    body = {"model": "sluice-tiny", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}]}
    first = httpx.post(up.url + "/v1/chat/completions", json=body,
                       headers=auth(TIGHT_KEY, **{"x-request-id": "tight-1"}), timeout=60)
    assert first.status_code == 200
    second = httpx.post(up.url + "/v1/chat/completions", json=body,
                        headers=auth(TIGHT_KEY, **{"x-request-id": "tight-2"}), timeout=60)
    assert second.status_code == 429
    root, eng, spans = trace_of(receiver, "tight-2", {"sluice.admission.reserve"}, None)
    assert root.name == "chat sluice-tiny"
    assert {s.name for s in spans if s.parent_span_id == root.span_id} == {
        "sluice.admission.reserve"}  # refused there: never queued nor dispatched
    marks = steps(root)
    assert list(marks) == [AUTH]  # nothing relayed, nothing held to settle
    assert marks[AUTH].attributes == {"sluice.tenant.id": "tight"}
    a = root.attributes
    assert a["http.response.status_code"] == 429 and a["sluice.outcome"] == "rejected_429"
    assert a["sluice.reject.reason"] == "requests_per_minute"
    assert 0 < a["sluice.retry_after_s"] <= float(second.headers["retry-after"])
    assert eng is None  # it never reached the engine


def closed_port() -> int:
    return free_port()  # bound and released: nothing listens there


def test_requests_succeed_while_the_collector_is_down(
        tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    with pytest.MonkeyPatch.context() as mp:
        # seconds: the SDK's exporter retries a refused connection with backoff until then
        u = up_with(tmp_path, mp, endpoint, OTEL_EXPORTER_OTLP_TIMEOUT="2")
    try:
        body = {"model": "sluice-tiny", "max_tokens": 6,
                "messages": [{"role": "user", "content": "hello"}]}
        for stream in (False, True, False, True):
            r = httpx.post(u.url + "/v1/chat/completions", json={**body, "stream": stream},
                           headers=auth(), timeout=60)
            assert r.status_code == 200, r.text
            assert ("data: [DONE]" in r.text) if stream else r.json()["choices"]
        deadline = time.monotonic() + 15
        failed = 0.0
        while time.monotonic() < deadline and not failed:
            for line in u.metrics().splitlines():
                if line.startswith('sluice_telemetry_spans_total{result="export_failed"}'):
                    failed = float(line.rsplit(" ", 1)[1])
            time.sleep(0.2)
        assert failed > 0  # the exporter did try, and failed, and counted it
        backend = httpx.get(u.backend_url + "/metrics", headers=u.backend_headers,
                            timeout=5).text
        assert 'sluice_telemetry_spans_total{result="export_failed"}' in backend
    finally:
        started = time.monotonic()
        assert u.stop() == 0
        assert time.monotonic() - started < 30  # no shutdown hang on the dead collector
    log = u.log()
    assert "span export through otlp_proto_http failed" in log  # Sluice's rate-limited line
    assert "Traceback" not in log
