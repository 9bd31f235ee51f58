"""The official openai SDK against `sluice up` (bundled tiny backend behind the gateway)."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import httpx
import openai
import pydantic
import pytest

from .conftest import ALPHA, BETA, SluiceUp

MODEL = "sluice-tiny"
RESOLVED = re.compile(r"^model=sluice-tiny; revision=[0-9a-f]{12}; tokenizer=[0-9a-f]{12}; "
                      r"chat_template=[0-9a-f]{12}; engine=sluice-engine/\S+; "
                      r"policy=(alpha|beta)@[0-9a-f]{12}$")


def client(up: SluiceUp, key: str = ALPHA) -> openai.OpenAI:
    return openai.OpenAI(base_url=up.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_chat_is_answered_and_stamped(sluice_up: SluiceUp) -> None:
    raw = client(sluice_up).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=8)
    resolved = raw.headers["x-sluice-resolved"]
    assert RESOLVED.match(resolved), resolved
    assert raw.headers["x-request-id"]
    chat = raw.parse()
    assert chat.model == MODEL
    assert chat.system_fingerprint and chat.system_fingerprint.startswith("fp_")
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage is not None and chat.usage.completion_tokens <= 8
    assert chat.usage.prompt_tokens > 0
    # The gateway's stamp names the backend's revision: the same as the backend reports.
    backend = httpx.get(sluice_up.backend_url + "/v1/models",
                        headers=sluice_up.backend_headers).json()["data"][0]
    assert f"revision={backend['revision'][:12]}" in resolved
    assert f"chat_template={backend['chat_template'][:12]}" in resolved
    # The fingerprint covers the policy: the other tenant gets another one.
    other = client(sluice_up, BETA).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=2)
    assert other.system_fingerprint != chat.system_fingerprint


def test_streaming_without_usage_hides_the_usage_chunk(sluice_up: SluiceUp) -> None:
    raw = client(sluice_up).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=12, stream=True)
    assert RESOLVED.match(raw.headers["x-sluice-resolved"])
    chunks = list(raw.parse())
    assert chunks, "no chunks"
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)  # no usage-only chunk
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    fingerprints = {c.system_fingerprint for c in chunks}
    assert len(fingerprints) == 1 and next(iter(fingerprints)).startswith("fp_")
    assert {c.model for c in chunks} == {MODEL}


def test_streaming_with_usage_reports_exact_counts(sluice_up: SluiceUp) -> None:
    stream = client(sluice_up).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=12,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert usage.completion_tokens == 12
    # the running usage the gateway asks the backend for is not shown to this client
    assert all(c.usage is None for c in chunks[:-1])
    # the exact prompt count equals what the backend's tokenizer says
    count = httpx.post(sluice_up.backend_url + "/v1/tokenize", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
        headers=sluice_up.backend_headers).json()["count"]
    assert usage.prompt_tokens == count


def test_completions(sluice_up: SluiceUp) -> None:
    raw = client(sluice_up).completions.with_raw_response.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5)
    assert RESOLVED.match(raw.headers["x-sluice-resolved"])
    done = raw.parse()
    assert done.object == "text_completion" and done.model == MODEL
    assert done.usage is not None and done.usage.completion_tokens <= 5
    streamed = list(client(sluice_up).completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, stream=True))
    assert streamed[-1].choices[0].finish_reason in ("stop", "length")


def test_models_list_shows_the_tenants_models_with_versions(sluice_up: SluiceUp) -> None:
    models = client(sluice_up).models.list().data
    assert [m.id for m in models] == [MODEL]
    extra = models[0].model_extra or {}
    assert len(extra["revision"]) == 64


def test_a_pin_that_matches_is_served(sluice_up: SluiceUp) -> None:
    revision = client(sluice_up).models.list().data[0].model_extra["revision"]
    chat = client(sluice_up).chat.completions.create(
        model=f"{MODEL}@{revision[:10]}", messages=[{"role": "user", "content": "x"}],
        max_tokens=2)
    assert chat.model == MODEL


def test_a_pin_no_server_serves_is_refused_until_the_next_refresh(sluice_up: SluiceUp) -> None:
    with pytest.raises(openai.InternalServerError) as info:
        client(sluice_up).chat.completions.create(
            model=f"{MODEL}@0000000000", messages=[{"role": "user", "content": "x"}],
            max_tokens=2)
    assert info.value.status_code == 503 and info.value.code == "revision_unavailable"
    assert info.value.response.headers["retry-after"]  # the refresh interval
    # stamped: the error happened after resolution
    assert RESOLVED.match(info.value.response.headers["x-sluice-resolved"])
    with pytest.raises(openai.BadRequestError) as short:  # too short to name a revision
        client(sluice_up).chat.completions.create(
            model=f"{MODEL}@000000", messages=[{"role": "user", "content": "x"}],
            max_tokens=2)
    assert short.value.code == "revision_mismatch"
    assert short.value.response.headers["x-should-retry"] == "false"


def test_errors_map_to_the_sdk_exceptions(sluice_up: SluiceUp) -> None:
    with pytest.raises(openai.AuthenticationError):
        client(sluice_up, "sk-wrong").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.NotFoundError) as nf:
        client(sluice_up).chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client(sluice_up).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], n=129)
    assert bad.value.param == "n"  # served up to 128
    with pytest.raises(openai.BadRequestError) as schema:  # a json_schema with no schema
        client(sluice_up).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": 5}})
    assert schema.value.param == "response_format"
    with pytest.raises(openai.BadRequestError) as unknown:
        client(sluice_up).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}],
            extra_body={"no_such_field": 1})
    assert unknown.value.param == "no_such_field"
    with pytest.raises(openai.PermissionDeniedError) as prio:
        client(sluice_up, BETA).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}],
            extra_body={"priority": 0})
    assert prio.value.param == "priority"


def test_caps_clamp_or_reject_as_the_tenant_says(sluice_up: SluiceUp) -> None:
    # alpha: max_tokens cap 1024, on_exceed clamp
    raw = client(sluice_up).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5000)
    assert raw.headers["x-sluice-clamped"] == "max_tokens=1024; requested=5000"
    raw = client(sluice_up).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3)
    assert "x-sluice-clamped" not in raw.headers
    # beta: cap 512, on_exceed reject
    with pytest.raises(openai.BadRequestError) as info:
        client(sluice_up, BETA).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=513)
    assert info.value.param == "max_tokens"
    # prompt tokens over the cap (beta: 4096): 413 naming the prompt
    long_prompt = "hello " * 5000
    with pytest.raises(openai.APIStatusError) as big:
        client(sluice_up, BETA).completions.create(model=MODEL, prompt=long_prompt,
                                                   max_tokens=1)
    assert big.value.status_code == 413 and big.value.code == "prompt_too_long"


def test_usage_is_settled_per_tenant_in_metrics(sluice_up: SluiceUp) -> None:
    def completion_tokens(text: str, tenant: str) -> int:
        m = re.search(rf'sluice_gateway_tokens_total{{tenant="{tenant}",type="completion"}} '
                      r"(\S+)", text)
        return int(float(m.group(1))) if m else 0

    before = completion_tokens(sluice_up.metrics(), "beta")
    client(sluice_up, BETA).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=7,
        extra_body={"ignore_eos": True})
    after = completion_tokens(sluice_up.metrics(), "beta")
    assert after - before == 7


def test_health_and_readiness(sluice_up: SluiceUp) -> None:
    assert httpx.get(sluice_up.url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(sluice_up.url + "/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"]["sluice-tiny"]["ok"] is True


class Weather(pydantic.BaseModel):
    """Every value from a short list: the tiny model's random weights end the answer soon."""

    city: Literal["Paris", "Rome"]
    rain: bool


def test_the_sdk_parses_a_pydantic_response_format(sluice_up: SluiceUp) -> None:
    """``client.beta.chat.completions.parse``, unchanged, through the gateway: the output
    follows the schema (on random weights only the constraint can do that), and the answer
    is stamped with the schema's hash."""
    raw = client(sluice_up).beta.chat.completions.with_raw_response.parse(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
        response_format=Weather, max_tokens=64)
    completion = raw.parse()
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Weather), completion.choices[0].message.content
    resolved = raw.headers["x-sluice-resolved"]
    assert RESOLVED.match(resolved.split("; schema=")[0]), resolved
    assert re.search(r"; schema=[0-9a-f]{12}$", resolved), resolved


def test_the_sdk_streams_a_tool_call(sluice_up: SluiceUp) -> None:
    tools: list[Any] = [{"type": "function", "function": {
        "name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"], "additionalProperties": False}}}]
    raw = client(sluice_up).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}], tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64, stream=True)
    assert re.search(r"; tools=[0-9a-f]{12}$", raw.headers["x-sluice-resolved"])
    chunks = list(raw.parse())
    calls = [c for chunk in chunks if chunk.choices
             for c in chunk.choices[0].delta.tool_calls or []]
    assert calls and calls[0].function is not None
    assert calls[0].function.name == "get_weather"
    arguments = "".join(c.function.arguments or "" for c in calls if c.function)
    assert json.loads(arguments)["city"] in ("Paris", "Rome")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
