"""The GenAI semantic-convention metrics after real requests: through the in-process gateway
in front of the scriptable upstream, and through a real `sluice backend --model tiny`; read
back from `/metrics` with prometheus_client's parser."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from modelfiles.tiny_model import ensure_tiny_model
from telemetry.genai import (
    DURATION_BUCKETS,
    REQUEST_DURATION,
    TIME_PER_OUTPUT_TOKEN,
    TIME_TO_FIRST_TOKEN,
    TOKEN_USAGE,
    TOKEN_USAGE_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
)
from tests.backend.server.conftest import Backend, start_backend
from tests.gateway.conftest import ThreadedGateway, auth, config_for, tenants_for_tests
from tests.gateway.fake_backend import FakeBackend

BUCKETS = {REQUEST_DURATION: DURATION_BUCKETS, TIME_TO_FIRST_TOKEN: TTFT_BUCKETS,
           TIME_PER_OUTPUT_TOKEN: TPOT_BUCKETS, TOKEN_USAGE: TOKEN_USAGE_BUCKETS}


def samples(text: str) -> list[Sample]:
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def total(found: list[Sample], name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels``."""
    return sum(s.value for s in found if s.name == name and labels.items() <= s.labels.items())


def scrape_until(url: str, headers: dict[str, str], done: Callable[[list[Sample]], bool],
                 timeout: float = 10) -> list[Sample]:
    """/metrics once ``done`` holds (a request is recorded as its answer goes out)."""
    deadline = time.monotonic() + timeout
    while True:
        found = samples(httpx.get(url + "/metrics", headers=headers, timeout=5).text)
        if done(found) or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def assert_semconv_buckets(found: list[Sample], names: tuple[str, ...]) -> None:
    """Every series of each histogram has exactly the conventions' boundaries, then +Inf."""
    for name in names:
        series: dict[frozenset[tuple[str, str]], list[float]] = {}
        for s in found:
            if s.name == name + "_bucket":
                key = frozenset((k, v) for k, v in s.labels.items() if k != "le")
                series.setdefault(key, []).append(float(s.labels["le"]))
        assert series, name
        for les in series.values():
            assert les == [*map(float, BUCKETS[name]), float("inf")], name


# ---- gateway ---------------------------------------------------------------------------------

@pytest.fixture
def fake() -> Iterator[FakeBackend]:
    with FakeBackend() as f:
        yield f


@pytest.fixture
def gw(fake: FakeBackend) -> Iterator[ThreadedGateway]:
    with ThreadedGateway(config_for(fake.url), tenants_for_tests()) as g:
        yield g


def test_the_gateway_records_the_genai_metrics(gw: ThreadedGateway, fake: FakeBackend) -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
    body = {**chat, "stream": True, "stream_options": {"include_usage": True}}
    usage: dict[str, int] = {}
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, headers=auth(),
                      timeout=30) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    done = httpx.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "one two"},
                      headers=auth(), timeout=30)
    assert done.status_code == 200
    refused = httpx.post(gw.url + "/v1/chat/completions", json=chat, headers=auth("sk-bad"),
                         timeout=30)
    assert refused.status_code == 401
    fake.mode = "500"
    failed = httpx.post(gw.url + "/v1/chat/completions", json=chat, headers=auth(), timeout=30)
    assert failed.status_code >= 500

    found = scrape_until(gw.url, {}, lambda f: total(f, REQUEST_DURATION + "_count") >= 4)
    base = {"gen_ai_provider_name": "sluice"}
    chat_m = {**base, "gen_ai_operation_name": "chat", "gen_ai_request_model": "m"}
    text_m = {**base, "gen_ai_operation_name": "text_completion", "gen_ai_request_model": "m"}
    duration = REQUEST_DURATION + "_count"
    assert total(found, duration) == 4
    assert total(found, duration, **chat_m, error_type="") == 1
    assert total(found, duration, **text_m, error_type="") == 1
    # refused before the model was resolved: no model, the error code as error.type
    assert total(found, duration, **base, gen_ai_operation_name="chat",
                 gen_ai_request_model="", error_type=refused.json()["error"]["code"]) == 1
    [upstream_failed] = [s for s in found if s.name == duration and s.labels["error_type"]
                         and s.labels["gen_ai_request_model"] == "m"]
    assert upstream_failed.value == 1
    # TTFT and TPOT: the successful stream only (a whole answer has no first chunk relayed)
    assert total(found, TIME_TO_FIRST_TOKEN + "_count") == 1
    assert total(found, TIME_TO_FIRST_TOKEN + "_count", **chat_m) == 1
    assert total(found, TIME_PER_OUTPUT_TOKEN + "_count", **chat_m) == 1
    # the same values as the gateway's own TTFT / TPOT
    assert total(found, TIME_TO_FIRST_TOKEN + "_sum") == pytest.approx(
        total(found, "sluice_gateway_ttft_seconds_sum"))
    assert total(found, TIME_PER_OUTPUT_TOKEN + "_sum") == pytest.approx(
        total(found, "sluice_gateway_tpot_seconds_sum"))
    # token usage: one observation per token type of each settled request
    tokens = TOKEN_USAGE + "_sum"
    assert total(found, TOKEN_USAGE + "_count", **chat_m, gen_ai_token_type="input") == 1
    assert total(found, tokens, **chat_m, gen_ai_token_type="input") == usage["prompt_tokens"]
    assert total(found, tokens, **chat_m, gen_ai_token_type="output") == \
        usage["completion_tokens"] == fake.chunks
    answer = done.json()["usage"]
    assert total(found, tokens, **text_m, gen_ai_token_type="input") == answer["prompt_tokens"]
    assert total(found, tokens, **text_m, gen_ai_token_type="output") == \
        answer["completion_tokens"]
    assert_semconv_buckets(found, tuple(BUCKETS))


# ---- backend ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    ensure_tiny_model()
    b = start_backend(tmp_path_factory.mktemp("genai"))
    yield b
    b.stop()


def stream_completion(url: str, body: dict[str, Any]) -> dict[str, Any]:
    usage: dict[str, Any] = {}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    return usage


def test_the_backend_records_the_genai_server_metrics(backend: Backend) -> None:
    streamed = stream_completion(backend.url, {"prompt": "count", "max_tokens": 4,
                                               "ignore_eos": True})
    assert streamed["completion_tokens"] == 4
    chat = httpx.post(backend.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "ignore_eos": True},
        timeout=60)
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 1
    bad = httpx.post(backend.url + "/v1/completions", json={"prompt": "x", "max_tokens": 0},
                     timeout=10)
    assert bad.status_code == 400
    err = bad.json()["error"]

    found = scrape_until(backend.url, {}, lambda f: total(f, REQUEST_DURATION + "_count") >= 3)
    model = httpx.get(backend.url + "/v1/models", timeout=5).json()["data"][0]["id"]
    base = {"gen_ai_provider_name": "sluice", "gen_ai_request_model": model}
    text = {**base, "gen_ai_operation_name": "text_completion"}
    chat_labels = {**base, "gen_ai_operation_name": "chat"}
    duration = REQUEST_DURATION + "_count"
    assert total(found, duration) == 3
    assert total(found, duration, **text, error_type="") == 1
    assert total(found, duration, **chat_labels, error_type="") == 1
    assert total(found, duration, **text, error_type=err["code"] or err["type"]) == 1
    # TTFT for both successes; TPOT only for the answer with >= 2 tokens
    assert total(found, TIME_TO_FIRST_TOKEN + "_count", **text) == 1
    assert total(found, TIME_TO_FIRST_TOKEN + "_count", **chat_labels) == 1
    assert total(found, TIME_PER_OUTPUT_TOKEN + "_count") == 1
    assert total(found, TIME_PER_OUTPUT_TOKEN + "_count", **text) == 1
    assert total(found, TIME_PER_OUTPUT_TOKEN + "_sum") == pytest.approx(
        total(found, "sluice_backend_tpot_seconds_sum"))
    assert not any(s.name.startswith(TOKEN_USAGE) for s in found)  # the gateway's only
    assert_semconv_buckets(found, (REQUEST_DURATION, TIME_TO_FIRST_TOKEN,
                                   TIME_PER_OUTPUT_TOKEN))
