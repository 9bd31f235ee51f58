"""Structured outputs and tool calls at the gateway (issue #24): ``response_format`` and
``tools`` reach a ``kind: sluice`` upstream; their schema's and tools' SHA-256 (canonical
JSON) are stamped on the answer and its span; they count in the prompt tokens and in the
worst case; a bad one is a 400 before anything is counted or reserved. The hashes are
computed here independently of the code under test."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.contract import ChatRequest, parse
from gateway.errors import BadRequest
from gateway.exchange import Exchange
from gateway.metrics import GatewayMetrics
from gateway.observe import observe, outcome_of
from gateway.outcome import Outcome
from gateway.resolve import Prepared, Resolver
from gateway.service import Gateway
from gateway.sse import ChunkRewriter
from gateway.structured import NO_EXTRAS, chat_extras
from gateway.tenants import Tenant
from gateway.timing import RequestTimes
from gateway.tokens import UpstreamCounter
from protocol.versions import SHORT
from telemetry.bench.otlp_sink import OtlpReceiver, ReceivedSpan
from telemetry.config import TelemetryConfig, TracesConfig
from tests.backend.server.conftest import BACKEND_KEY, GATEWAY_KEY_ENV
from tests.gateway.stage_kit import (
    Client,
    Scripted,
    Spans,
    chunk,
    config,
    gateway,
    quota_tenant,
    reply,
    sse,
    tenant,
)

from .conftest import SluiceUp, ThreadedGateway, auth, config_for, tenants_for_tests
from .fake_backend import FakeBackend

MESSAGES = [{"role": "user", "content": "the weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"},
                                           "température": {"type": "number"}},
          "required": ["city"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA,
                                                 "strict": True}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CHAT = {"model": "m", "messages": MESSAGES, "max_tokens": 8}
USAGE = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
STREAM = sse(chunk("a"), chunk(None, finish="stop"), chunk(None, usage=USAGE), "[DONE]")
WHOLE = json.dumps({"id": "x", "object": "chat.completion", "created": 1, "model": "fake-model",
                    "system_fingerprint": "fp_up", "usage": USAGE, "choices": [
                        {"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "{}"}}]}).encode()


def sha256(value: Any) -> str:
    """The issue's definition, written out: SHA-256 of the canonical JSON (sorted keys, no
    whitespace, UTF-8)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def suffix(schema: Any = None, tools: Any = None) -> str:
    """What the stamp gets after the server's versions."""
    out = "" if schema is None else f"; schema={sha256(schema)[:SHORT]}"
    return out + ("" if tools is None else f"; tools={sha256(tools)[:SHORT]}")


def with_schema(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def versions(body: dict[str, Any], bundled: bool) -> dict[str, str]:
    """The request's own versions, as the gateway derives them for this kind of upstream."""
    req = parse("chat", {**CHAT, **body})
    assert isinstance(req, ChatRequest)
    return chat_extras(req, bundled).versions()


# ---- the hashes ---------------------------------------------------------------------------

@pytest.mark.parametrize("bundled", [True, False])
def test_the_versions_are_the_sha256_of_the_canonical_json(bundled: bool) -> None:
    both = versions({"response_format": FORMAT, "tools": TOOLS}, bundled)
    assert both == {"schema": sha256(SCHEMA), "tools": sha256(TOOLS)}
    # one spelling per value: key order is not part of it
    shuffled = {k: SCHEMA[k] for k in reversed(list(SCHEMA))}
    assert versions({"response_format": with_schema(shuffled)}, bundled) == {
        "schema": sha256(SCHEMA)}
    # a json_object is any object; text asks for nothing
    assert versions({"response_format": {"type": "json_object"}}, bundled) == {
        "schema": sha256({"type": "object"})}
    assert versions({"response_format": {"type": "text"}}, bundled) == {}
    assert versions({}, bundled) == {}


def test_another_server_validates_the_fields_itself() -> None:
    """What the bundled backend refuses, another server may serve (legacy ``functions``,
    other format types): for it the gateway only hashes what it recognizes."""
    for body, param in (({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
                        ({"response_format": {"type": "structural_tag", "x": 1}},
                         "response_format")):
        assert versions(body, bundled=False) == {}
        with pytest.raises(BadRequest) as refused:
            versions(body, bundled=True)
        assert refused.value.param == param


# ---- the stamp, the span, the count: the request path in memory (an OpenAI upstream) -----

async def run(gw: Gateway, body: dict[str, Any], who: Tenant | None = None,
              trace: Spans | None = None) -> tuple[Exchange, Client]:
    client = Client()
    ex = Exchange(gw, "chat", who or quota_tenant(), reply(client, gw.metrics, trace or Spans()),
                  RequestTimes(0.0))
    await ex.run(body, None)
    return ex, client


@pytest.mark.parametrize("stream", [False, True])
async def test_the_answer_and_its_span_carry_the_schema_and_the_tools(stream: bool) -> None:
    answers = [Scripted(chunks=[STREAM if stream else WHOLE]) for _ in range(2)]
    gw = gateway(config(), {"http://m0": answers})
    plain_ex, plain = await run(gw, {**CHAT, "stream": stream})
    trace = Spans()
    ex, client = await run(gw, {**CHAT, "stream": stream, "response_format": FORMAT,
                                "tools": TOOLS}, trace=trace)
    assert client.status == plain.status == 200
    server = plain.headers[b"x-sluice-resolved"].decode()
    stamped = client.headers[b"x-sluice-resolved"].decode()
    assert stamped == server + suffix(SCHEMA, TOOLS), stamped
    assert trace.attrs["sluice.schema_sha256"] == sha256(SCHEMA)  # full hex on the span
    assert trace.attrs["sluice.tools_sha256"] == sha256(TOOLS)
    # the body's fingerprint stays the servers' versions: the same as without them
    fingerprints = {line for line in client.body.split(b'"') if line.startswith(b"fp_")}
    assert fingerprints == {line for line in plain.body.split(b'"') if line.startswith(b"fp_")}
    assert len(fingerprints) == 1
    # forwarded as the client sent them
    body = json.loads(gw.upstreams["m"].members[0].pool.posts[-1][1])  # type: ignore[attr-defined]
    assert body["response_format"] == FORMAT and body["tools"] == TOOLS
    assert ex.ended is not None and ex.ended.outcome is Outcome.SUCCESS
    assert plain_ex.ended is not None


async def test_requests_differing_only_in_the_schema_get_different_stamps() -> None:
    gw = gateway(config(), {"http://m0": [Scripted(chunks=[WHOLE]) for _ in range(3)]})
    other = {**SCHEMA, "required": ["city", "température"]}
    stamps = []
    for schema in (SCHEMA, other, SCHEMA):
        _, client = await run(gw, {**CHAT, "response_format": with_schema(schema)})
        stamps.append(client.headers[b"x-sluice-resolved"].decode())
    assert stamps[0] != stamps[1] and stamps[0] == stamps[2]
    assert stamps[0].endswith(suffix(SCHEMA)) and stamps[1].endswith(suffix(other))


async def test_an_error_after_resolution_is_stamped_with_them_too() -> None:
    gw = gateway(config(), {"http://m0": []})
    _, client = await run(gw, {**CHAT, "tools": TOOLS}, quota_tenant(tokens_per_minute=3))
    assert client.status == 429
    assert client.headers[b"x-sluice-resolved"].decode().endswith(suffix(tools=TOOLS))


async def prepare(r: Resolver, body: dict[str, Any], who: Tenant | None = None) -> Prepared:
    who = who or tenant()
    req = parse("chat", body)
    return await r.prepare("chat", req, body, await r.target(req, who), who, "rid", None)


async def test_the_byte_bound_counts_the_tools_and_the_schema() -> None:
    r = gateway(config(), {}).resolver
    plain = await prepare(r, CHAT)
    tools = await prepare(r, {**CHAT, "tools": TOOLS})
    schema = await prepare(r, {**CHAT, "response_format": with_schema(SCHEMA)})
    big = {**SCHEMA, "description": "x" * 5000}
    bigger = await prepare(r, {**CHAT, "response_format": with_schema(big)})
    assert tools.prompt_tokens >= plain.prompt_tokens + len(json.dumps(TOOLS)) - 64
    assert schema.prompt_tokens > plain.prompt_tokens
    assert bigger.prompt_tokens >= schema.prompt_tokens + 5000
    for p in (plain, tools, schema, bigger):  # and so in the worst case reserved
        assert p.worst_case == p.prompt_tokens + 8


# ---- a kind: sluice upstream (the fake backend) ------------------------------------------

@pytest.fixture
def fake() -> Iterator[FakeBackend]:
    with FakeBackend() as f:
        yield f


@pytest.fixture
def sluice_gw(fake: FakeBackend) -> Iterator[ThreadedGateway]:
    with ThreadedGateway(config_for(fake.url), tenants_for_tests()) as g:
        yield g


def post(g: ThreadedGateway, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(g.url + "/v1/chat/completions", json=body, headers=auth(), timeout=30)


def test_a_sluice_upstream_gets_the_fields_and_counts_them(
        sluice_gw: ThreadedGateway, fake: FakeBackend) -> None:
    assert post(sluice_gw, CHAT).status_code == 200  # versions read, connection warm
    reads = fake.models_reads
    body = {**CHAT, "response_format": FORMAT, "tools": TOOLS, "tool_choice": "auto"}
    r = post(sluice_gw, body)
    assert r.status_code == 200, r.text
    sent = fake.bodies[-1]
    assert sent["response_format"] == FORMAT and sent["tools"] == TOOLS
    assert sent["tool_choice"] == "auto"
    # counted by the upstream, with what it renders
    assert fake.tokenize_bodies[-1] == {"model": "fake-model", "messages": MESSAGES,
                                        "tools": TOOLS, "response_format": FORMAT}
    # the gateway's stamp (the backend's own schema=/tools= are not the server's versions:
    # they neither replace the gateway's nor make it read the versions again)
    assert r.headers["x-sluice-resolved"].endswith(suffix(SCHEMA, TOOLS))
    assert fake.models_reads == reads


def test_counts_are_cached_per_schema_and_tools(
        sluice_gw: ThreadedGateway, fake: FakeBackend) -> None:
    other = {**SCHEMA, "description": "another"}
    for body in ({**CHAT, "response_format": FORMAT}, {**CHAT, "response_format": FORMAT},
                 {**CHAT, "response_format": with_schema(other)},
                 {**CHAT, "response_format": FORMAT, "tools": TOOLS}):
        assert post(sluice_gw, body).status_code == 200
    asked = [(b.get("response_format"), b.get("tools")) for b in fake.tokenize_bodies]
    assert asked == [(FORMAT, None), (with_schema(other), None), (FORMAT, TOOLS)]


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": with_schema(5)}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_a_bad_schema_or_tool_is_a_400_before_anything_is_counted_or_reserved(
        sluice_gw: ThreadedGateway, fake: FakeBackend, extra: dict[str, Any],
        param: str) -> None:
    r = post(sluice_gw, {**CHAT, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert fake.tokenize_bodies == [] and fake.bodies == []
    usage = sluice_gw.call(sluice_gw.gateway.admission.store.usage("one"))
    assert usage["reserved"]["day"] == 0 and usage["settled"]["day"] == 0
    assert usage["concurrency"] == 0


async def test_an_upstream_tokenizer_refusing_the_tools_is_a_400_naming_them() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        param = "tools" if "tools" in body else "model"  # a field not counted: not named
        return httpx.Response(400, json={"error": {"message": "no", "type": "x",
                                                   "code": "y", "param": param}})

    req = parse("chat", {**CHAT, "tools": TOOLS})
    assert isinstance(req, ChatRequest)
    async with httpx.AsyncClient(transport=httpx.MockTransport(refuse),
                                 base_url="http://up") as client:
        counter = UpstreamCounter(client, "m", lambda: "v")
        for extras, param in ((chat_extras(req, bundled=False), "tools"),
                              (NO_EXTRAS, "messages")):
            with pytest.raises(BadRequest) as refused:
                await counter.count("chat", MESSAGES, extras)
            assert refused.value.param == param


# ---- other OpenAI-compatible upstreams ---------------------------------------------------

def test_a_generic_upstream_without_the_capability_refuses_them(fake: FakeBackend) -> None:
    cfg = config_for(fake.url, kind="openai", tokenizer="bytes", supports=["n", "seed"])
    with ThreadedGateway(cfg, tenants_for_tests()) as g:
        for extra, param in (({"tools": TOOLS}, "tools"),
                             ({"response_format": FORMAT}, "response_format")):
            r = post(g, {**CHAT, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert r.json()["error"]["code"] == "unsupported_parameter"
    assert fake.bodies == []


def test_a_generic_upstream_that_serves_them_gets_them_stamped(fake: FakeBackend) -> None:
    cfg = config_for(fake.url, kind="openai", tokenizer="upstream")
    with ThreadedGateway(cfg, tenants_for_tests()) as g:
        r = post(g, {**CHAT, "response_format": FORMAT, "tools": TOOLS})
    assert r.status_code == 200, r.text
    assert r.headers["x-sluice-resolved"].endswith(suffix(SCHEMA, TOOLS))
    assert fake.bodies[-1]["response_format"] == FORMAT
    # its /v1/tokenize renders the tools; it puts no schema in the prompt
    assert fake.tokenize_bodies[-1] == {"model": "fake-model", "messages": MESSAGES,
                                        "tools": TOOLS}


# ---- the span, exported -------------------------------------------------------------------

def test_the_request_span_names_the_schema_and_the_tools(
        fake: FakeBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    with OtlpReceiver() as rx:
        cfg = config_for(fake.url).model_copy(update={"telemetry": TelemetryConfig(
            traces=TracesConfig(exporter="otlp", endpoint=rx.endpoint))})
        with ThreadedGateway(cfg, tenants_for_tests()) as g:
            r = httpx.post(g.url + "/v1/chat/completions", timeout=30,
                           json={**CHAT, "response_format": FORMAT, "tools": TOOLS},
                           headers={**auth(), "x-request-id": "structured-1"})
            assert r.status_code == 200, r.text

            def mine(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
                return [s for s in spans
                        if s.attributes.get("sluice.request.id") == "structured-1"
                        and "sluice.outcome" in s.attributes]

            root = mine(rx.wait_for(lambda spans: bool(mine(spans)), timeout=15))[0]
    assert root.attributes["sluice.schema_sha256"] == sha256(SCHEMA)
    assert root.attributes["sluice.tools_sha256"] == sha256(TOOLS)


# ---- the bundled backend: counts equal its own --------------------------------------------

@pytest.fixture
def real_gw(sluice_up: SluiceUp, monkeypatch: pytest.MonkeyPatch,
            request: pytest.FixtureRequest) -> Iterator[ThreadedGateway]:
    """A gateway in front of `sluice up`'s bundled backend, counting with ``param``."""
    monkeypatch.setenv(GATEWAY_KEY_ENV, BACKEND_KEY)
    cfg = config_for(sluice_up.backend_url, upstream_model="sluice-tiny",
                     tokenizer=request.param, api_key_env=GATEWAY_KEY_ENV)
    with ThreadedGateway(cfg, tenants_for_tests()) as g:
        yield g


def backend_count(up: SluiceUp, body: dict[str, Any]) -> int:
    fields = {k: body[k] for k in ("messages", "tools", "response_format") if k in body}
    r = httpx.post(up.backend_url + "/v1/tokenize", json={"model": "sluice-tiny", **fields},
                   headers=up.backend_headers, timeout=30)
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


@pytest.mark.parametrize("real_gw", ["upstream", "local:tiny"], indirect=True)
def test_tools_and_schema_count_as_the_backend_counts_them(
        real_gw: ThreadedGateway, sluice_up: SluiceUp) -> None:
    big = {**SCHEMA, "description": "a long description of the answer " * 20}
    bodies = [CHAT, {**CHAT, "tools": TOOLS}, {**CHAT, "response_format": FORMAT},
              {**CHAT, "response_format": with_schema(big)},
              {**CHAT, "response_format": {"type": "json_object"}},
              {**CHAT, "response_format": FORMAT, "tools": TOOLS},
              {**CHAT, "messages": [{"role": "system", "content": "Be brief."}, *MESSAGES],
               "response_format": FORMAT}]
    prepared = [real_gw.call(prepare(real_gw.gateway.resolver, b)) for b in bodies]
    counts = [p.prompt_tokens for p in prepared]
    assert counts == [backend_count(sluice_up, b) for b in bodies]
    assert all(p.prompt_exact and p.worst_case == p.prompt_tokens + 8 for p in prepared)
    plain, tools, schema, bigger = counts[:4]
    assert tools > plain and schema > plain and bigger > schema + 100
    # and the backend, answering, reports the same prompt
    r = post(real_gw, {**bodies[5], "model": "m"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == counts[5]


# ---- streamed tool calls are output: they time the first token ----------------------------

def call_chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "fake-model",
            "system_fingerprint": "fp_up", "usage": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


FIRST_CALL = {"index": 0, "id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": ""}}
# as the bundled backend streams a call: the role, the call's first delta, its arguments
BUNDLED_CALLS = [call_chunk({"role": "assistant", "content": None}),
                 call_chunk({"tool_calls": [FIRST_CALL]}),
                 call_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
                 call_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
                 call_chunk({}, finish="tool_calls")]
# as OpenAI streams one: the role with the first delta (content and refusal null)
OPENAI_CALLS = [call_chunk({"role": "assistant", "content": None, "refusal": None,
                            "tool_calls": [FIRST_CALL]}), *BUNDLED_CALLS[2:]]


@pytest.mark.parametrize("events", [BUNDLED_CALLS, OPENAI_CALLS])
@pytest.mark.parametrize("compact", [True, False])
def test_tool_call_deltas_count_as_output_on_both_paths(events: list[dict[str, Any]],
                                                        compact: bool) -> None:
    sep = (",", ":") if compact else (", ", ": ")
    raw = [b"data: " + json.dumps(e, separators=sep).encode() for e in events]
    fast = ChunkRewriter("m", "fp_g", False, False)
    for e in raw:
        fast.rewrite(e)
    assert fast._fast is not None  # the byte-level path was learned and taken
    slow = ChunkRewriter("m", "fp_g", False, False)
    for e in raw:
        slow._rewrite_json(e[6:])  # the json path only
    calls = sum(1 for e in events if e["choices"][0]["delta"].get("tool_calls"))
    assert fast.tokens == slow.tokens == calls == 3
    assert fast.finish_reason == slow.finish_reason == "tool_calls"
    # the role-only opening chunk and an empty list carry nothing
    empty = ChunkRewriter("m", "fp_g", False, False)
    for delta in ({"role": "assistant", "content": None}, {"tool_calls": []},
                  {"content": ""}):
        empty.rewrite(b"data: " + json.dumps(call_chunk(delta), separators=sep).encode())
    assert empty.tokens == 0


class FirstTokens(Spans):
    def __init__(self) -> None:
        super().__init__()
        self.first_tokens: list[float] = []

    def first_token(self, ttft_s: float) -> None:
        self.first_tokens.append(ttft_s)


def observed(metrics: GatewayMetrics | str, name: str) -> float:
    """How many observations the histogram ``sluice_gateway_<name>`` holds, all labels."""
    text = metrics if isinstance(metrics, str) else metrics.render()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"sluice_gateway_{name}_count"))


async def test_a_streamed_tool_call_answer_times_its_first_token() -> None:
    """TTFT, TPOT and ITL, and the span's first-token event, for an answer of calls only
    (an OpenAI or vLLM upstream: no content delta at all)."""
    usage = {"prompt_tokens": 4, "completion_tokens": 9, "total_tokens": 13}
    stream = sse(*OPENAI_CALLS, chunk(None, usage=usage), "[DONE]")
    gw = gateway(config(), {"http://m0": [Scripted(chunks=[stream])]})
    trace, client = FirstTokens(), Client()
    answer = reply(client, gw.metrics, trace)
    ex = Exchange(gw, "chat", quota_tenant(), answer, RequestTimes(time.monotonic()))
    await ex.run({**CHAT, "stream": True, "tools": TOOLS, "tool_choice": "required"}, None)
    observe(gw.metrics, answer, ex.ended, ex.times, outcome_of(answer, ex.ended), "chat")
    assert client.status == 200 and b'"tool_calls"' in client.body
    assert ex.ended is not None and ex.ended.outcome is Outcome.SUCCESS
    assert ex.times.first is not None and len(trace.first_tokens) == 1
    assert observed(gw.metrics, "ttft_seconds") == 1
    assert observed(gw.metrics, "tpot_seconds") == 1
    assert observed(gw.metrics, "itl_seconds") == 2  # three chunks of output: two gaps


@pytest.mark.parametrize("real_gw", ["upstream"], indirect=True)
def test_the_bundled_backend_s_streamed_calls_time_the_first_token(
        real_gw: ThreadedGateway) -> None:
    before = observed(httpx.get(real_gw.url + "/metrics", timeout=5).text, "ttft_seconds")
    weather = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
               "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]
    with httpx.stream("POST", real_gw.url + "/v1/chat/completions", headers=auth(), timeout=60,
                      json={**CHAT, "model": "m", "max_tokens": 60, "stream": True,
                            "tools": tools, "tool_choice": "required",
                            "parallel_tool_calls": False}) as r:
        assert r.status_code == 200
        data = b"".join(r.iter_bytes())
    assert b'"tool_calls"' in data and b'"finish_reason":"tool_calls"' in data, data
    after = observed(httpx.get(real_gw.url + "/metrics", timeout=5).text, "ttft_seconds")
    assert after == before + 1
