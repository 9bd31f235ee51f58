"""stream_options.continuous_usage_stats: running usage on every chunk (vLLM's extension)."""

from __future__ import annotations

import json

import httpx

from .conftest import Backend


def events(backend: Backend, options: dict) -> list[dict]:
    body = {"messages": [{"role": "user", "content": "count"}], "max_tokens": 6,
            "ignore_eos": True, "stream": True, "stream_options": options}
    with httpx.stream("POST", backend.url + "/v1/chat/completions", json=body,
                      timeout=60) as resp:
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: {")]
    return [json.loads(line) for line in lines]


def test_running_usage_on_every_content_chunk(backend: Backend) -> None:
    chunks = events(backend, {"include_usage": True, "continuous_usage_stats": True})
    content = [c for c in chunks[1:] if c["choices"]]  # after the role chunk
    counts = [c["usage"]["completion_tokens"] for c in content]
    assert counts == sorted(counts) and counts[-1] == 6 and counts[0] >= 1
    assert all(c["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"]
               for c in content)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_without_it_usage_is_null_until_the_end(backend: Backend) -> None:
    chunks = events(backend, {"include_usage": True})
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] == 6
