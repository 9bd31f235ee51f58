"""Logprobs, logit bias and penalties over HTTP, in OpenAI's shapes, parsed by the official
``openai`` SDK, whole and streamed (against a running `sluice backend --model tiny`)."""

from __future__ import annotations

import math

import openai
import pytest

from .conftest import Backend

MODEL = "sluice-tiny"
MESSAGES = [{"role": "user", "content": "Say something about rivers."}]


@pytest.fixture(scope="module")
def client(backend: Backend) -> openai.OpenAI:
    return openai.OpenAI(base_url=backend.url + "/v1", api_key="unused", max_retries=0,
                         timeout=30)


def test_chat_logprobs_whole_and_streamed(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "messages": MESSAGES, "max_tokens": 10, "temperature": 0,
          "logprobs": True, "top_logprobs": 3, "extra_body": {"ignore_eos": True}}
    out = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    choice = out.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert out.usage is not None and len(content) == out.usage.completion_tokens == 10
    for item in content:
        assert bytes(item.bytes or []) == item.token.encode()
        assert len(item.top_logprobs) == 3
        tops = [t.logprob for t in item.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(v <= 0 for v in tops)
        # greedy, no penalties: the sampled token is the most likely one
        assert item.token == item.top_logprobs[0].token
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kw):  # type: ignore[call-overload]
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.content or [])
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_whole_and_streamed(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.7,
          "seed": 11, "logprobs": 2, "extra_body": {"ignore_eos": True}}
    out = client.completions.create(**kw)  # type: ignore[call-overload]
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert all(math.isfinite(v) and v <= 0 for v in lp.token_logprobs)
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3  # the top 2 and the sampled one
        if "\ufffd" in (token, *top):
            # top_logprobs is keyed by text (OpenAI's format): byte-fragment tokens all
            # read "\ufffd" and share one key
            continue
        assert len(top) >= 2 and top[token] == value
    tokens: list[str] = []
    values: list[float] = []
    text_offset: list[int] = []
    text = ""
    for chunk in client.completions.create(stream=True, **kw):  # type: ignore[call-overload]
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens or []
                values += c.logprobs.token_logprobs or []
                text_offset += c.logprobs.text_offset or []
    assert text == out.choices[0].text
    assert (tokens, values, text_offset) == (lp.tokens, lp.token_logprobs, lp.text_offset)


def test_logit_bias_and_penalties(client: openai.OpenAI) -> None:
    forced = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4,
                                       temperature=0, logit_bias={"65": 100}, logprobs=0,
                                       extra_body={"ignore_eos": True})
    lp = forced.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(set(lp.tokens)) == 1
    assert forced.choices[0].text == lp.tokens[0] * 4
    banned = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert banned.choices[0].text != forced.choices[0].text

    def distinct(**extra: float) -> int:
        out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=48,
                                        temperature=0, logprobs=0,
                                        extra_body={"ignore_eos": True}, **extra)  # type: ignore[call-overload]
        lps = out.choices[0].logprobs
        assert lps is not None and lps.tokens is not None
        return len(set(lps.tokens))

    assert distinct(presence_penalty=2.0, frequency_penalty=2.0) > distinct()
