"""Structured outputs and tool calls against a running `sluice backend --model tiny`.

The tiny model's weights are random: only a real constraint makes its output parse. Inside
a JSON string it may wander for long before closing it, so these requests carry a
``logit_bias`` favouring the closing tokens (``"``, ``}``, ``]``, ``,``) and the end token:
the grammar still decides what is valid, the bias only stands in for a trained model's wish
to finish.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings

from protocol.sse import EventSplitter, event_data
from protocol.structured import sha256_of, split_tool_calls
from protocol.versions import short
from tests.backend.engine.schemas import satisfiable, schemas

from .conftest import Backend

MODEL = "sluice-tiny"
CLOSERS = {"5": 8, "96": 8, "64": 8, "15": 4, "3": 5}  # " } ] , <|im_end|>: the tiny ids
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather",
                                            "description": "The weather in a city",
                                            "parameters": WEATHER_PARAMS}}
NOOP = {"type": "function", "function": {"name": "noop"}}
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                               "minItems": 1, "maxItems": 3},
                                      "ok": {"type": "boolean"}},
     "required": ["tags", "ok"], "additionalProperties": False},
    {"$defs": {"P": {"type": "object", "properties": {"x": {"type": "number"}},
                     "required": ["x"], "additionalProperties": False}},
     "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}, "q": {"type": "null"}},
     "required": ["p"], "additionalProperties": False},
]


# tool parameters: generated object schemas of the keywords the engine enforces
parameter_schemas = schemas.filter(lambda s: s.get("type") == "object" and satisfiable(s))


def chat(backend: Backend, **body: Any) -> httpx.Response:
    payload = {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "seed": 7,
               "logit_bias": CLOSERS, **body}
    return httpx.post(backend.url + "/v1/chat/completions", json=payload, timeout=60)


def ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def stream_chunks(backend: Backend, **body: Any) -> list[dict[str, Any]]:
    payload = {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "seed": 7,
               "logit_bias": CLOSERS, "stream": True, **body}
    with httpx.stream("POST", backend.url + "/v1/chat/completions", json=payload,
                      timeout=60) as r:
        assert r.status_code == 200
        data = b"".join(r.iter_bytes())
    events = [event_data(e) for e in EventSplitter().feed(data)]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1] if e is not None]


def reassemble(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Each choice's content, tool calls and finish_reason, as a client builds them."""
    out: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            choice = out.setdefault(c["index"], {"content": "", "tool_calls": [],
                                                 "finish_reason": None})
            delta = c["delta"]
            choice["content"] += delta.get("content") or ""
            for d in delta.get("tool_calls", []):
                calls = choice["tool_calls"]
                if "id" in d:
                    assert d["index"] == len(calls)
                    calls.append({"id": d["id"], "type": d["type"],
                                  "function": dict(d["function"])})
                else:
                    calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
            if c["finish_reason"] is not None:
                assert choice["finish_reason"] is None
                choice["finish_reason"] = c["finish_reason"]
    return out


def check_call(call: dict[str, Any], tools: list[dict[str, Any]]) -> None:
    """An OpenAI tool call whose arguments validate against its function's parameters."""
    assert call["type"] == "function" and call["id"].startswith("call_")
    params = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"})
              for t in tools}
    fn = call["function"]
    assert fn["name"] in params and isinstance(fn["arguments"], str)
    args = json.loads(fn["arguments"])
    assert isinstance(args, dict)
    jsonschema.validate(args, params[fn["name"]])


# ---- response_format ------------------------------------------------------------------------
def test_json_object_parses(backend: Backend) -> None:
    r = chat(backend, response_format={"type": "json_object"})
    choice = ok(r)["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert isinstance(json.loads(choice["message"]["content"]), dict)
    assert f"; schema={short(sha256_of({'type': 'object'}))}" in r.headers["x-sluice-resolved"]


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_validates(backend: Backend, schema: dict[str, Any], strict: bool) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema,
                                                  "strict": strict}}
    r = chat(backend, response_format=fmt, n=2)
    body = ok(r)
    for choice in body["choices"]:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    resolved = r.headers["x-sluice-resolved"]
    assert resolved.endswith(f"; schema={short(sha256_of(schema))}")
    assert "tools=" not in resolved


def test_streamed_json_schema_validates(backend: Backend) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMAS[0]}}
    choice = reassemble(stream_chunks(backend, response_format=fmt))[0]
    assert choice["finish_reason"] == "stop" and choice["tool_calls"] == []
    jsonschema.validate(json.loads(choice["content"]), SCHEMAS[0])


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "format": "no-such-format"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"oneOf": [{"type": "string"},
                                          {"type": "string", "minLength": 2}]}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"d": {"type": "string", "format": "nope"}}}}}]},
     "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": [WEATHER], "ignore_eos": True}, "ignore_eos"),
    ({"tools": [WEATHER], "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "format": "no-such-format"}}}},
     "response_format"),  # beside tools, the refusal still names the right field
    # ... also where the turn is calls only: the format is checked (and stamped) in every mode
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}},
     "response_format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "response_format": {"type": "json_schema", "json_schema": {
          "name": "x", "schema": {"type": "string", "format": "no-such-format"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": False}}},
     "response_format"),
    ({"messages": [*MESSAGES, {"role": "tool", "tool_call_id": "call_1", "content": "x"}]},
     "messages"),  # a result of no call
])
def test_bad_requests_are_400s_naming_the_field(backend: Backend, body: dict[str, Any],
                                                param: str) -> None:
    r = chat(backend, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_schema_of_true_is_any_json_value(backend: Backend) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "any", "schema": True}}
    r = chat(backend, response_format=fmt)
    choice = ok(r)["choices"][0]
    assert choice["finish_reason"] == "stop"
    json.loads(choice["message"]["content"])
    assert r.headers["x-sluice-resolved"].endswith(f"; schema={short(sha256_of(True))}")
    beside = ok(chat(backend, response_format=fmt, tools=[WEATHER], tool_choice="required"))
    assert beside["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(("params", "pointer"), [
    ({"type": "object", "properties": {"d": {"$ref": "#/$defs/Missing"}}}, "/$defs/Missing"),
    ({"type": "object", "properties": {"d": False}, "required": ["d"]}, "'d'"),
])
def test_tool_refusals_name_the_client_s_schema_not_the_grammar(
        backend: Backend, params: dict[str, Any], pointer: str) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    for choice in ("auto", "required"):
        r = chat(backend, tools=[tool], tool_choice=choice)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "tools" and pointer in error["message"], error
        for internal in ("%json", "x-guidance", "call_rest", "/properties/arguments", "\n"):
            assert internal not in error["message"], error


# ---- tools ----------------------------------------------------------------------------------
def test_a_parameter_named_default_holding_a_reference(backend: Backend) -> None:
    """A property named like a data keyword is a schema: its $ref is rebased, not a 400."""
    params = {"type": "object", "$defs": {"Inner": {"type": "integer", "minimum": 1,
                                                     "maximum": 9}},
              "properties": {"default": {"$ref": "#/$defs/Inner"}}, "required": ["default"],
              "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    choice = ok(chat(backend, tools=[tool], tool_choice="required"))["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    for call in choice["message"]["tool_calls"]:
        check_call(call, [tool])


@pytest.mark.parametrize("n", [1, 3])
def test_required_tools_answer_tool_calls(backend: Backend, n: int) -> None:
    r = chat(backend, tools=[WEATHER, NOOP], tool_choice="required", n=n)
    body = ok(r)
    assert len(body["choices"]) == n
    for choice in body["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        message = choice["message"]
        assert message["role"] == "assistant" and message["content"] is None
        assert message["refusal"] is None  # as OpenAI's messages always have it
        assert message["tool_calls"]
        for call in message["tool_calls"]:
            check_call(call, [WEATHER, NOOP])
    assert r.headers["x-sluice-resolved"].endswith(
        f"; tools={short(sha256_of([WEATHER, NOOP]))}")


def test_a_named_function_without_parallel_calls_is_one_call_of_it(backend: Backend) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = ok(chat(backend, tools=[NOOP, WEATHER], tool_choice=choice,
                   parallel_tool_calls=False))
    calls = body["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    check_call(calls[0], [WEATHER])
    assert body["choices"][0]["finish_reason"] == "tool_calls"


def test_streamed_tool_calls_are_the_whole_answer_s(backend: Backend) -> None:
    fields = {"tools": [WEATHER, NOOP], "tool_choice": "required", "n": 2}
    whole = ok(chat(backend, **fields))["choices"]
    chunks = stream_chunks(backend, **fields)
    # the answer can only be calls: OpenAI's opening delta, content null
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [
        {"role": "assistant", "content": None}] * 2
    streamed = reassemble(chunks)
    assert sorted(streamed) == [0, 1]
    for i, choice in enumerate(whole):
        got = streamed[i]
        assert got["finish_reason"] == "tool_calls" and got["content"] == ""

        def strip(calls: list[dict[str, Any]]) -> list[Any]:
            return [(c["type"], c["function"]["name"], c["function"]["arguments"])
                    for c in calls]

        assert strip(got["tool_calls"]) == strip(choice["message"]["tool_calls"])  # ids aside
        assert len({c["id"] for c in got["tool_calls"]}) == len(got["tool_calls"])
    last = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert all(c["choices"][0]["delta"] == {} for c in last)


def test_tool_choice_none_answers_text(backend: Backend) -> None:
    body = ok(chat(backend, tools=[WEATHER], tool_choice="none", max_tokens=8,
                   logit_bias={}))
    message = body["choices"][0]["message"]
    assert "tool_calls" not in message and isinstance(message["content"], str)


OPEN = "31"  # "<": the tiny tokenizer's first token of "<tool_call>"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auto_completes_a_call_the_model_starts(backend: Backend, seed: int) -> None:
    """Under ``auto`` beside a JSON format the model chooses, at its first token, between
    the answer ("{") and a call ("<"): a bias toward "<" makes it start a call by itself,
    and the grammar must then force a whole valid one. With the same bias and no grammar
    (``tool_choice: none``), the output is no valid call: the grammar made it one.

    (The tiny model cannot be biased into writing "<tool_call>" in free text, as ``auto``
    without a format would need: over its 7 tokens, the best static bias gives it a
    probability near 1e-11, and greedy decoding cannot be made to write it at all.)"""
    bias = {**CLOSERS, OPEN: 8}
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMAS[0]}}
    body = ok(chat(backend, tools=[WEATHER], response_format=fmt, seed=seed, logit_bias=bias))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None and choice["message"]["tool_calls"]
    for call in choice["message"]["tool_calls"]:
        check_call(call, [WEATHER])
    free = ok(chat(backend, tools=[WEATHER], tool_choice="none", seed=seed, logit_bias=bias))
    content = free["choices"][0]["message"]["content"]
    assert "<" in content and split_tool_calls(content) is None, content
    # biased away from "<", the same request answers in the format: the model chose
    answer = ok(chat(backend, tools=[WEATHER], response_format=fmt, seed=seed,
                     logit_bias={**CLOSERS, OPEN: -8}))["choices"][0]
    assert answer["finish_reason"] == "stop" and "tool_calls" not in answer["message"]
    jsonschema.validate(json.loads(answer["message"]["content"]), SCHEMAS[0])


def test_auto_without_a_format_is_constrained_text(backend: Backend) -> None:
    """``auto`` alone still constrains: its free text is never empty (the end token cannot
    come first), where the same request under ``none`` may end at once."""
    eos = {"3": 100}
    auto = ok(chat(backend, tools=[WEATHER], logit_bias=eos))["choices"][0]
    assert auto["finish_reason"] == "stop" and auto["message"]["content"]
    assert "<tool_call>" not in auto["message"]["content"]
    free = ok(chat(backend, tools=[WEATHER], tool_choice="none", logit_bias=eos))["choices"][0]
    assert free["message"]["content"] == ""


def test_tool_results_in_the_history(backend: Backend) -> None:
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    body = ok(chat(backend, messages=history, tools=[WEATHER], tool_choice="none",
                   max_tokens=4))
    assert body["choices"][0]["message"]["content"] is not None
    r = chat(backend, messages=[*MESSAGES, {"role": "tool", "content": "x"}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_tool_and_schema_text_count_in_prompt_tokens(backend: Backend) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMAS[0]}}
    plain = ok(chat(backend, max_tokens=1, logit_bias={}))["usage"]["prompt_tokens"]
    body = ok(chat(backend, tools=[WEATHER], response_format=fmt, max_tokens=1))
    counted = body["usage"]["prompt_tokens"]
    assert counted > plain + len(json.dumps(WEATHER)) // 4
    r = httpx.post(backend.url + "/v1/tokenize", json={
        "model": MODEL, "messages": MESSAGES, "tools": [WEATHER], "response_format": fmt})
    assert r.status_code == 200 and r.json()["count"] == counted
    bad = httpx.post(backend.url + "/v1/tokenize", json={
        "messages": MESSAGES, "response_format": {"type": "yaml"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
    prompt = httpx.post(backend.url + "/v1/tokenize", json={"prompt": "x", "tools": [WEATHER]})
    assert prompt.status_code == 400 and prompt.json()["error"]["param"] == "tools"


# ---- the official SDK -----------------------------------------------------------------------
class Person(pydantic.BaseModel):
    name: str
    age: int
    friends: list[str]


@pytest.fixture(scope="module")
def client(backend: Backend) -> openai.OpenAI:
    return openai.OpenAI(base_url=backend.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def test_sdk_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    out = client.beta.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Person, max_tokens=400, seed=3,
        logit_bias=CLOSERS)  # type: ignore[arg-type]
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)


def test_sdk_accumulates_a_calls_only_stream_with_content_none(client: openai.OpenAI) -> None:
    with client.beta.chat.completions.stream(
            model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="required",  # type: ignore[list-item]
            max_tokens=400, seed=3, logit_bias=CLOSERS) as stream:  # type: ignore[arg-type]
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert message.content is None and message.tool_calls


def test_sdk_tools_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="required",  # type: ignore[list-item]
        max_tokens=400, seed=3, logit_bias=CLOSERS, stream=True)  # type: ignore[arg-type]
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                if d.function is not None:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert reasons == ["tool_calls"] and calls
    for call in calls.values():
        assert call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), WEATHER_PARAMS)


def test_streamed_tool_calls_lose_no_logprobs(backend: Backend) -> None:
    chunks = stream_chunks(backend, tools=[WEATHER], tool_choice="required", logprobs=True,
                           top_logprobs=2, stream_options={"include_usage": True})
    tokens = sum(len(c["choices"][0]["logprobs"]["content"]) for c in chunks
                 if c["choices"] and c["choices"][0]["logprobs"])
    assert tokens == chunks[-1]["usage"]["completion_tokens"] > 0
    assert reassemble(chunks)[0]["finish_reason"] == "tool_calls"


async def test_a_cancelled_constrained_request_frees_its_blocks(backend: Backend) -> None:
    from .test_cancellation import RawClient, wait_state

    before = await asyncio.to_thread(backend.state)
    client = RawClient(backend.port)
    # no closing bias: inside the city string the tiny model wanders for long
    reader = await client.send("/v1/chat/completions", {
        "messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required", "stream": True,
        "max_tokens": 1500, "seed": 1})
    await client.read_events(reader, 3)
    running = await asyncio.to_thread(backend.state)
    assert running["running"] == 1
    assert running["grammar_sequences"] == before["grammar_sequences"] + 1
    client.disconnect()
    state = await wait_state(backend, lambda s: s["running"] == 0 and s["waiting"] == 0, 30)
    assert state["kv_blocks_free"] == before["kv_blocks_free"]
    assert state["grammar_sequences"] == before["grammar_sequences"] == 0  # its matcher too


@pytest.fixture(scope="module")
def closers(tiny_model_dir: Any) -> dict[str, float]:
    from modelfiles.tokenizer import Tokenizer
    from tests.backend.engine.schemas import closing_bias

    return {str(i): b for i, b in closing_bias(Tokenizer.from_dir(tiny_model_dir))}


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(params=parameter_schemas)
def test_generated_parameter_schemas_give_valid_calls(backend: Backend, closers: dict[str, float],
                                                      params: dict[str, Any]) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    body = ok(chat(backend, tools=[tool], tool_choice="required", parallel_tool_calls=False,
                   logit_bias=closers, max_tokens=600))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    check_call(call, [tool])


def test_state_and_metrics_count_compiles_and_cache_hits(backend: Backend) -> None:
    """A schema compiled once, then served from the cache; /metrics says so."""
    schema = {"type": "object", "properties": {"metric_probe": {"enum": [1, 2]}},
              "required": ["metric_probe"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "probe", "schema": schema}}
    before = backend.state()
    for _ in range(3):
        ok(chat(backend, response_format=fmt))
    after = backend.state()
    assert after["grammar_compiles"] == before["grammar_compiles"] + 1
    assert after["grammar_cache_hits"] == before["grammar_cache_hits"] + 2
    text = httpx.get(backend.url + "/metrics").text
    values = {ln.split()[0]: float(ln.split()[-1]) for ln in text.splitlines()
              if ln.startswith("sluice_backend_grammar_")}
    assert values["sluice_backend_grammar_compiles_total"] == after["grammar_compiles"]
    assert values["sluice_backend_grammar_cache_hits_total"] == after["grammar_cache_hits"]
    assert values["sluice_backend_grammar_sequences"] == 0
