"""The backend's traces and metrics: a real `sluice backend --model tiny` subprocess exporting
over OTLP/HTTP to the test receiver, and its `/metrics` read with prometheus_client."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from modelfiles.tiny_model import ensure_tiny_model
from telemetry.bench.otlp_sink import OtlpReceiver, ReceivedSpan
from tests.backend.server.conftest import Backend, start_backend
from tests.backend.server.test_cancellation import RawClient, stream_body

PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"
SERVER, INTERNAL = 2, 1  # proto SpanKind values
STATUS_UNSET, STATUS_ERROR = 0, 2
CHUNK_BUDGET = 16  # --max-num-batched-tokens: a 40-token prompt is prefilled in 3 chunks
PHASES = ("engine.queue", "engine.prefill", "engine.decode")


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def traced(receiver: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    ensure_tiny_model()
    with pytest.MonkeyPatch.context() as mp:  # the standard environment alone says where
        mp.setenv("OTEL_TRACES_EXPORTER", "otlp")
        mp.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        mp.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        for name in ("OTEL_SDK_DISABLED", "OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER",
                     "OTEL_METRICS_EXPORTER", "OTEL_RESOURCE_ATTRIBUTES"):
            mp.delenv(name, raising=False)
        b = start_backend(tmp_path_factory.mktemp("traced"), "--max-num-batched-tokens",
                          str(CHUNK_BUDGET))
    yield b
    b.stop()


def tree(rx: OtlpReceiver, request_id: str, children: tuple[str, ...]) -> tuple[
        ReceivedSpan, dict[str, ReceivedSpan]]:
    """The request's span (SERVER, named ``chat sluice-tiny`` etc.) and its children by
    name, once all arrived."""
    def find(spans: list[ReceivedSpan]) -> ReceivedSpan | None:
        return next((s for s in spans if s.kind == SERVER
                     and s.attributes.get("sluice.request.id") == request_id), None)

    def ready(spans: list[ReceivedSpan]) -> bool:
        root = find(spans)
        return root is not None and set(children) <= {
            s.name for s in spans if s.parent_span_id == root.span_id}

    spans = rx.wait_for(ready, timeout=15)
    root = find(spans)
    assert root is not None
    return root, {s.name: s for s in spans if s.parent_span_id == root.span_id}


def stream_completion(url: str, body: dict[str, Any], headers: dict[str, str],
                      ids: list[str] | None = None) -> dict[str, Any]:
    """A streamed completion; returns its usage (include_usage), and appends each chunk's
    ``id`` to ``ids`` if given."""
    usage: dict[str, Any] | None = None
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers,
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                if ids is not None:
                    ids.append(event["id"])
    assert usage is not None
    return usage


def resolved(url: str) -> dict[str, Any]:
    return httpx.get(url + "/v1/models", timeout=5).json()["data"][0]


def test_a_streamed_completion_is_traced_under_the_callers_span(
        traced: Backend, receiver: OtlpReceiver) -> None:
    model = resolved(traced.url)
    prompt = list(range(200, 240))  # 40 tokens, in no earlier request: nothing cached
    body = {"model": model["id"], "prompt": prompt, "max_tokens": 6, "ignore_eos": True,
            "temperature": 0.5, "top_p": 0.9, "seed": 7, "priority": 2}
    ids: list[str] = []
    usage = stream_completion(traced.url, body, {
        "traceparent": TRACEPARENT, "x-sluice-tenant": "acme", "x-request-id": "trace-1"}, ids)
    response_id = ids[0]
    assert set(ids) == {response_id}
    root, kids = tree(receiver, "trace-1", PHASES)

    assert (root.trace_id, root.parent_span_id, root.kind) == (PARENT_TRACE, PARENT_SPAN, SERVER)
    # GenAI semantic conventions: "{gen_ai.operation.name} {gen_ai.request.model}"
    assert root.name == f"text_completion {model['id']}"
    assert root.status_code == STATUS_UNSET
    res = root.resource
    assert res["service.name"] == "sluice-backend"
    assert res["telemetry.sdk.name"] == "opentelemetry"
    assert res["telemetry.sdk.language"] == "python"
    assert res["service.version"] and res["service.instance.id"]
    assert all(k.resource == res for k in kids.values())
    assert root.scope == "sluice.backend"
    a = root.attributes
    assert a["sluice.tenant.id"] == "acme"
    assert a["sluice.priority"] == 2
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.provider.name"] == "sluice"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == model["id"]
    assert a["gen_ai.request.max_tokens"] == 6
    assert a["gen_ai.request.stream"] is True and "sluice.stream" not in a
    assert a["gen_ai.response.id"] == response_id
    assert a["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] == 40
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 6
    assert a["gen_ai.usage.cache_read.input_tokens"] == \
        usage["prompt_tokens_details"]["cached_tokens"]
    assert "gen_ai.usage.cached_tokens" not in a
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert (a["sluice.model.revision"], a["sluice.tokenizer"], a["sluice.engine"]) == (
        model["revision"], model["tokenizer"], model["engine"])
    assert a.get("sluice.chat_template") == model["chat_template"]
    assert a["http.response.status_code"] == 200
    assert a["sluice.outcome"] == "success"
    assert a["sluice.ttft_ms"] > 0 and a["sluice.queue_ms"] >= 0
    assert a["sluice.ttft_ms"] >= a["sluice.queue_ms"]
    assert a["gen_ai.response.time_to_first_chunk"] == pytest.approx(
        a["sluice.ttft_ms"] / 1000, abs=1e-3)

    queue, prefill, decode = (kids[n] for n in PHASES)
    for span in (queue, prefill, decode):
        assert (span.trace_id, span.kind) == (PARENT_TRACE, INTERNAL)
    assert root.start_ns <= queue.start_ns <= queue.end_ns <= prefill.start_ns
    assert prefill.start_ns <= prefill.end_ns <= decode.start_ns <= decode.end_ns <= root.end_ns
    assert "engine.abort" not in kids

    chunks = [e for e in prefill.events if e.name == "engine.prefill.chunk"]
    assert len(chunks) >= 2  # 40 tokens on a 16-token step budget
    assert sum(e.attributes["sluice.chunk.tokens"] for e in chunks) == 40
    position = 0
    for e in chunks:  # contiguous, in order, inside the prefill span
        assert e.attributes["sluice.chunk.start"] == position
        assert e.attributes["sluice.chunk.tokens"] <= CHUNK_BUDGET
        assert e.attributes["sluice.chunk.step_ms"] >= 0
        assert prefill.start_ns <= e.time_ns <= prefill.end_ns
        position += e.attributes["sluice.chunk.tokens"]
    assert prefill.attributes["sluice.prefill.chunks"] == len(chunks)
    assert decode.attributes["gen_ai.usage.output_tokens"] == 6
    assert decode.attributes["sluice.preemptions"] == 0
    assert decode.attributes["sluice.prefix_cache.hit_tokens"] == 0


def test_a_chat_without_traceparent_is_a_root_span(traced: Backend,
                                                   receiver: OtlpReceiver) -> None:
    r = httpx.post(traced.url + "/v1/chat/completions", timeout=60,
                   headers={"x-request-id": "chat-1"},
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                         "ignore_eos": True})
    assert r.status_code == 200
    root, kids = tree(receiver, "chat-1", PHASES)
    assert root.parent_span_id is None and root.trace_id != PARENT_TRACE
    served = resolved(traced.url)["id"]
    assert root.name == f"chat {served}"  # the served model: the body named none
    a = root.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["sluice.tenant.id"] == "-"
    assert a["gen_ai.provider.name"] == "sluice"
    assert a["gen_ai.response.model"] == r.json()["model"] == served
    assert a["gen_ai.response.id"] == r.json()["id"]
    assert a["gen_ai.request.stream"] is False
    assert a["gen_ai.request.max_tokens"] == 3
    assert a["gen_ai.response.finish_reasons"] == [r.json()["choices"][0]["finish_reason"]]
    assert a["gen_ai.usage.output_tokens"] == r.json()["usage"]["completion_tokens"] == 3
    assert "gen_ai.request.temperature" not in a and "gen_ai.request.model" not in a
    assert all(k.trace_id == root.trace_id for k in kids.values())


async def test_a_client_that_leaves_mid_stream_yields_engine_abort(
        traced: Backend, receiver: OtlpReceiver) -> None:
    client = RawClient(traced.port, b"traceparent: %s\r\nx-sluice-tenant: cancel-t\r\n"
                       b"x-request-id: cancel-1\r\n" % TRACEPARENT.encode())
    reader = await client.send("/v1/chat/completions", stream_body())
    await client.read_events(reader, 3)
    client.disconnect()  # the socket closes on the loop's next turn: wait off the loop
    root, kids = await asyncio.to_thread(tree, receiver, "cancel-1", (
        "engine.queue", "engine.prefill", "engine.decode", "engine.abort"))
    assert (root.trace_id, root.parent_span_id) == (PARENT_TRACE, PARENT_SPAN)
    assert root.name.startswith("chat ")
    a = root.attributes
    assert a["sluice.outcome"] == "cancelled"
    assert a["gen_ai.response.finish_reasons"] == ["abort"]
    assert a["http.response.status_code"] == 200  # the stream had started
    assert 3 <= a["gen_ai.usage.output_tokens"] < 1500
    abort = kids["engine.abort"]
    assert abort.attributes["sluice.abort.reason"] == "client_disconnect"
    assert 0 <= abort.attributes["sluice.tokens_after_abort"] <= 2
    assert kids["engine.decode"].start_ns <= abort.start_ns <= abort.end_ns <= root.end_ns
    assert abort.end_ns == kids["engine.decode"].end_ns  # the abort ended the request
    # Its metrics were recorded with the trace: the outcome is counted.
    text = (await asyncio.to_thread(httpx.get, traced.url + "/metrics", timeout=5)).text
    assert total(text, "sluice_backend_requests_total", tenant="cancel-t",
                 outcome="cancelled") == 1


def test_a_rejected_request_gets_a_request_span_with_the_error(
        traced: Backend, receiver: OtlpReceiver) -> None:
    r = httpx.post(traced.url + "/v1/completions", timeout=10,
                   headers={"traceparent": TRACEPARENT, "x-request-id": "bad-1",
                            "x-sluice-tenant": "acme"},
                   json={"prompt": "hello", "max_tokens": 0})
    assert r.status_code == 400
    err = r.json()["error"]
    root, kids = tree(receiver, "bad-1", ())
    assert (root.trace_id, root.parent_span_id) == (PARENT_TRACE, PARENT_SPAN)
    assert kids == {}
    assert root.name == "text_completion"  # refused before a model was accepted
    a = root.attributes
    assert a["gen_ai.operation.name"] == "text_completion"
    assert "gen_ai.response.id" not in a  # no response was made
    assert a["http.response.status_code"] == 400
    assert a["error.type"] == (err["code"] or err["type"])
    assert a["sluice.outcome"] == "invalid" and a["sluice.tenant.id"] == "acme"
    assert root.status_code == STATUS_UNSET  # 4xx is the client's error, not the server's


def total(text: str, sample: str, **labels: str) -> float:
    """Sum of the samples named ``sample`` whose labels include ``labels``."""
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == sample and labels.items() <= s.labels.items())


def test_metrics_count_what_the_requests_did(traced: Backend) -> None:
    tenant = "metrics-t"
    lengths = [1, 2, 5, 8]
    usages = [stream_completion(traced.url, {"prompt": f"count {i}", "max_tokens": n,
                                             "ignore_eos": True, "priority": 5},
                                {"x-sluice-tenant": tenant})
              for i, n in enumerate(lengths)]
    bad = httpx.post(traced.url + "/v1/completions", headers={"x-sluice-tenant": tenant},
                     json={"prompt": "x", "max_tokens": 0}, timeout=10)
    assert bad.status_code == 400
    assert [u["completion_tokens"] for u in usages] == lengths
    n = len(lengths)
    text = httpx.get(traced.url + "/metrics", timeout=5).text
    deadline = time.monotonic() + 5  # the last request is recorded as its answer goes out
    while total(text, "sluice_backend_requests_total", tenant=tenant) < n + 1 \
            and time.monotonic() < deadline:
        time.sleep(0.05)
        text = httpx.get(traced.url + "/metrics", timeout=5).text

    def t(sample: str, **labels: str) -> float:
        return total(text, sample, tenant=tenant, **labels)

    assert t("sluice_backend_requests_total", outcome="success") == n
    assert t("sluice_backend_requests_total", outcome="invalid") == 1
    assert t("sluice_backend_requests_total") == n + 1
    assert t("sluice_backend_output_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert t("sluice_backend_input_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    p = {"priority_class": "p4-6"}
    assert t("sluice_backend_ttft_seconds_count", **p) == n
    assert t("sluice_backend_e2e_seconds_count", **p) == n
    assert t("sluice_backend_queue_time_seconds_count", **p) == n
    assert t("sluice_backend_tpot_seconds_count", **p) == sum(1 for k in lengths if k >= 2)
    assert t("sluice_backend_itl_seconds_count", **p) == sum(k - 1 for k in lengths)
    assert t("sluice_backend_itl_seconds_bucket", le="+Inf", **p) == sum(k - 1 for k in lengths)
    assert t("sluice_backend_ttft_seconds_sum") > 0
    hit_rate = total(text, "sluice_backend_prefix_cache_hit_rate")
    assert 0 <= hit_rate <= 1
    assert 0 <= total(text, "sluice_backend_kv_cache_usage_ratio") <= 1
    for name in ("sluice_backend_prefill_tokens_saved_total",
                 "sluice_backend_preemptions_total",
                 "sluice_backend_time_to_first_token_seconds_count",
                 "sluice_backend_request_queue_time_seconds_count"):
        assert any(s.name == name for fam in text_string_to_metric_families(text)
                   for s in fam.samples), name


def test_tracing_off_by_default_costs_no_spans(tmp_path: Path) -> None:
    """Without OTEL_TRACES_EXPORTER nothing is exported (and the server still serves)."""
    ensure_tiny_model()
    with OtlpReceiver() as rx, pytest.MonkeyPatch.context() as mp:
        mp.delenv("OTEL_TRACES_EXPORTER", raising=False)
        mp.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
        b = start_backend(tmp_path)
        try:
            usage = stream_completion(b.url, {"prompt": "quiet", "max_tokens": 2,
                                              "ignore_eos": True}, {})
            assert usage["completion_tokens"] == 2
        finally:
            b.stop()
        assert rx.spans() == []


def test_a_bad_otel_setting_stops_the_backend_before_the_model_loads(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from sluice.cli import main

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")  # traces on: their settings count
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "2")
    assert main(["backend", "--model", "/nonexistent/model", "--no-api-key"]) == 2
    err = capsys.readouterr().err
    assert "cannot start" in err and "OTEL_TRACES_SAMPLER_ARG" in err
