"""The official openai SDK against a running `sluice backend --model tiny`."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import Backend

MODEL = "sluice-tiny"


@pytest.fixture(scope="module")
def client(backend: Backend) -> openai.OpenAI:
    return openai.OpenAI(base_url=backend.url + "/v1", api_key="unused", max_retries=0,
                         timeout=30)


def tokenize(backend: Backend, **body: object) -> int:
    r = httpx.post(backend.url + "/v1/tokenize", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["count"] == len(data["tokens"])
    return int(data["count"])


MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say something about rivers."}]


def test_models_lists_the_tiny_model_with_versions(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    extra = models.data[0].model_dump()
    assert extra["revision"] and extra["tokenizer"] and extra["chat_template"]
    assert extra["engine"].startswith("sluice-engine/")


def test_chat_completion(client: openai.OpenAI, backend: Backend) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                         temperature=0, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason == "length"
    assert out.object == "chat.completion"
    assert out.system_fingerprint and out.system_fingerprint.startswith("fp_")
    assert out.usage is not None
    assert out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens == tokenize(backend, messages=MESSAGES)
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens is not None


def test_chat_streaming_with_usage(client: openai.OpenAI, backend: Backend) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 10
    assert usage_chunk.usage.prompt_tokens == tokenize(backend, messages=MESSAGES)
    assert all(c.usage is None for c in chunks[:-1])
    assert all(c.system_fingerprint == chunks[0].system_fingerprint for c in chunks)
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert text == whole.choices[0].message.content


def test_completion_string_and_token_prompt(client: openai.OpenAI, backend: Backend) -> None:
    prompt = "The river runs"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion"
    assert out.usage is not None and out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens == tokenize(backend, prompt=prompt)
    ids = httpx.post(backend.url + "/v1/tokenize", json={"prompt": prompt}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == out.choices[0].text


def test_completion_streaming(client: openai.OpenAI) -> None:
    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_max_completion_tokens_and_stop(client: openai.OpenAI) -> None:
    base = client.completions.create(model=MODEL, prompt="Hello", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                         max_completion_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.usage is not None and out.usage.completion_tokens == 5
    stop = base[3:6]
    assert stop.strip(), base
    stopped = client.completions.create(model=MODEL, prompt="Hello", max_tokens=20,
                                        temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == base[:base.index(stop)]


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def run(seed: int) -> str:
        return client.completions.create(
            model=MODEL, prompt="Once", max_tokens=16, temperature=1.0, top_p=0.9, seed=seed,
            extra_body={"top_k": 50, "ignore_eos": True}).choices[0].text

    assert run(42) == run(42)


def test_min_p_reaches_the_sampler(client: openai.OpenAI) -> None:
    """min_p = 1 keeps only the likeliest token: a sampled request answers as greedy does
    (sampling at temperature 1 without it does not, on the tiny model's flat logits)."""
    def run(**kw: object) -> str:
        return client.completions.create(
            model=MODEL, prompt="Once", max_tokens=16, seed=7,
            extra_body={"ignore_eos": True, **kw.pop("extra", {})},  # type: ignore[dict-item]
            **kw).choices[0].text  # type: ignore[call-overload]

    greedy = run(temperature=0)
    assert run(temperature=1.0, extra={"min_p": 1.0}) == greedy
    assert run(temperature=1.0) != greedy


def test_errors_raise_sdk_exceptions(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=0)
    assert bad.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as many:
        client.completions.create(model=MODEL, prompt="hi", n=129)
    assert many.value.param == "n"
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model=MODEL, prompt=[5] * 5000, max_tokens=4)
    assert long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)


def test_request_id_and_resolved_headers(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, extra_headers={"x-request-id": "my-id-1"})
    assert raw.headers["x-request-id"] == "my-id-1"
    assert raw.headers["x-sluice-resolved"].startswith(f"model={MODEL}; revision=")
    assert raw.parse().id.endswith("my-id-1")
    generated = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=2)
    assert len(generated.headers["x-request-id"]) >= 16
    # The generated id names the response and the engine request too.
    assert generated.parse().id == "chatcmpl-" + generated.headers["x-request-id"]
