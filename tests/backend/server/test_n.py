"""``n`` > 1 over HTTP: k choices with their indexes, whole and streamed, usage counting the
prompt once and the completions of every choice, and a client that leaves aborting them all
(the official openai SDK for the API, raw httpx where the bytes matter)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from .conftest import Backend

MODEL = "sluice-tiny"
MESSAGES = [{"role": "user", "content": "Tell me about the sea, in many words."}]


@pytest.fixture(scope="module")
def client(backend: Backend) -> openai.OpenAI:
    return openai.OpenAI(base_url=backend.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def test_chat_n4_whole_and_streamed(client: openai.OpenAI) -> None:
    extra = {"ignore_eos": True}
    one = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=9,
                                         temperature=0, extra_body=extra)
    four = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=9,
                                          temperature=0, n=4, extra_body=extra)
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    assert {c.message.content for c in four.choices} == {one.choices[0].message.content}
    assert [c.finish_reason for c in four.choices] == ["length"] * 4
    assert one.usage is not None and four.usage is not None
    assert four.usage.prompt_tokens == one.usage.prompt_tokens  # counted once
    assert four.usage.completion_tokens == 4 * 9
    assert four.usage.total_tokens == one.usage.prompt_tokens + 36

    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=9, temperature=0, n=4, stream=True,
        stream_options={"include_usage": True}, extra_body=extra)
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    roles: list[int] = []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role == "assistant":
                roles.append(c.index)
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                assert c.index not in reasons
                reasons[c.index] = c.finish_reason
    assert sorted(roles) == [0, 1, 2, 3]
    assert texts == {i: four.choices[i].message.content for i in range(4)}
    assert reasons == {i: "length" for i in range(4)}
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (one.usage.prompt_tokens, 36)


def test_seeded_completions_give_distinct_reproducible_choices(backend: Backend) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "n": 3,
            "temperature": 1.0, "seed": 77, "ignore_eos": True}
    first = httpx.post(backend.url + "/v1/completions", json=body, timeout=60).json()
    again = httpx.post(backend.url + "/v1/completions", json=body, timeout=60).json()
    texts = [c["text"] for c in first["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert texts == [c["text"] for c in again["choices"]]
    assert len(set(texts)) == 3
    assert first["usage"]["completion_tokens"] == 24

    streamed: dict[int, str] = {}
    with httpx.stream("POST", backend.url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
    assert streamed == dict(enumerate(texts))


def test_a_client_that_leaves_aborts_every_choice(backend: Backend) -> None:
    before = backend.state()
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1500, "n": 4,
            "ignore_eos": True, "stream": True}
    seen: set[int] = set()
    running = 0
    with httpx.stream("POST", backend.url + "/v1/chat/completions", json=body,
                      timeout=60) as r:
        for line in r.iter_lines():  # leaving the loop closes the connection
            if line.startswith("data: {") and '"content":""' not in line:
                seen.update(c["index"] for c in json.loads(line[6:])["choices"])
            if len(seen) == 4:
                running = backend.state()["running"]
                if running == 4:
                    break
    assert running == 4
    deadline = time.monotonic() + 10
    while True:
        st = backend.state()
        if st["running"] == 0 and st["kv_blocks_free"] == st["kv_blocks_total"]:
            break
        assert time.monotonic() < deadline, st
        time.sleep(0.02)
    assert st["aborted"] == before["aborted"] + 1
    assert st["waiting"] == 0
