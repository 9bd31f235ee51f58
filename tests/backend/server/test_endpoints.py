"""State, metrics, tokenize, health, request ids, prefix cache and greedy equivalence."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from .conftest import Backend

STATE_KEYS = {"kv_blocks_total", "kv_blocks_free", "block_size", "running", "waiting",
              "preemptions", "prefix_cache_queries", "prefix_cache_hits", "max_num_seqs",
              "max_model_len", "weight_bytes", "resolved"}


def test_health_and_state(backend: Backend) -> None:
    assert httpx.get(backend.url + "/health").json()["status"] == "ok"
    state = backend.state()
    assert STATE_KEYS <= set(state)
    assert set(state["resolved"]) == {"model", "revision", "tokenizer", "chat_template",
                                      "engine"}
    assert state["max_model_len"] == 2048 and state["block_size"] == 16


def test_metrics_exposition(backend: Backend) -> None:
    httpx.post(backend.url + "/v1/completions",
               json={"prompt": "metrics", "max_tokens": 3, "ignore_eos": True}, timeout=30)
    r = httpx.get(backend.url + "/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("kv_blocks_used", "kv_blocks_total", "num_requests_running",
                 "num_requests_waiting", "preemptions_total", "prefix_cache_hits_total",
                 "prefix_cache_queries_total"):
        assert f"\nsluice_backend_{name} " in text, name
    for hist in ("request_queue_time_seconds", "time_to_first_token_seconds",
                 "time_per_output_token_seconds"):
        count = [ln for ln in text.splitlines() if ln.startswith(f"sluice_backend_{hist}_count")]
        assert count and float(count[0].split()[-1]) >= 1, hist
        assert f'sluice_backend_{hist}_bucket{{le="+Inf"}}' in text


def test_tokenize_prompt_and_messages(backend: Backend) -> None:
    r = httpx.post(backend.url + "/v1/tokenize", json={"prompt": "hello world"}).json()
    assert r["count"] == len(r["tokens"]) > 0
    msgs = [{"role": "user", "content": "hello world"}]
    m = httpx.post(backend.url + "/v1/tokenize", json={"messages": msgs}).json()
    assert m["count"] > r["count"]  # the template adds its markers
    bad = httpx.post(backend.url + "/v1/tokenize", json={"prompt": "a", "messages": msgs})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_prefix_cache_reports_cached_tokens(backend: Backend) -> None:
    prompt = list(range(10, 10 + 80))  # 5 full blocks
    body = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True, "cache_salt": "t1"}
    first = httpx.post(backend.url + "/v1/completions", json=body, timeout=30).json()
    second = httpx.post(backend.url + "/v1/completions", json=body, timeout=30).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    other_salt = httpx.post(backend.url + "/v1/completions",
                            json={**body, "cache_salt": "t2"}, timeout=30).json()
    assert other_salt["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_version_pin(backend: Backend) -> None:
    rev = backend.state()["resolved"]["revision"]
    ok = httpx.post(backend.url + "/v1/completions",
                    json={"model": f"sluice-tiny@{rev[:12]}", "prompt": "a", "max_tokens": 1})
    assert ok.status_code == 200
    bad = httpx.post(backend.url + "/v1/completions",
                     json={"model": "sluice-tiny@deadbeef00", "prompt": "a", "max_tokens": 1})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "revision_mismatch"
    short = httpx.post(backend.url + "/v1/completions",  # a prefix, but under 7 characters
                       json={"model": f"sluice-tiny@{rev[:6]}", "prompt": "a", "max_tokens": 1})
    assert short.status_code == 400 and short.json()["error"]["code"] == "revision_mismatch"
    assert short.json()["error"]["message"].endswith(
        f"a pin needs at least 7 hex characters of the revision (or all of it), "
        f"and {rev[:6]!r} has 6")


async def test_duplicate_request_ids_in_flight(backend: Backend) -> None:
    body = {"prompt": "dup", "max_tokens": 20, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=backend.url, timeout=30) as c:
        rs = await asyncio.gather(*(c.post("/v1/completions", json=body,
                                           headers={"x-request-id": "same"})
                                    for _ in range(3)))
    assert [r.status_code for r in rs] == [200, 200, 200]
    assert all(r.headers["x-request-id"] == "same" for r in rs)
    assert len({r.json()["id"] for r in rs}) == 3  # engine ids made unique


def test_priority_is_accepted(backend: Backend) -> None:
    # Validated here; the ordering itself is the engine's (tested there).
    r = httpx.post(backend.url + "/v1/completions",
                   json={"prompt": "p", "max_tokens": 1, "priority": -5})
    assert r.status_code == 200
    bad = httpx.post(backend.url + "/v1/completions",
                     json={"prompt": "p", "max_tokens": 1, "priority": "high"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_greedy_http_equals_engine(backend: Backend, kind: str) -> None:
    """Greedy text and tokens through HTTP equal the engine's for the same prompt."""
    from backend.engine.async_engine import AsyncEngine
    from backend.engine.config import EngineConfig
    from backend.engine.sampling import SamplingParams

    messages = [{"role": "user", "content": "Tell me about the sea and the wind."}]
    prompt = "In the beginning the river"
    engine = await asyncio.to_thread(AsyncEngine.from_config, EngineConfig(model="tiny"))
    tok = engine.info.tokenizer
    ids = (tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
           if kind == "chat" else tok.encode(prompt))
    async with engine:
        stream = await engine.generate("ref", ids, SamplingParams(max_tokens=40, temperature=0))
        text, n = "", 0
        async for d in stream:
            text += d.text
            n = d.num_output_tokens
            reason = d.finish_reason
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    body: dict[str, object] = {"max_tokens": 40, "temperature": 0}
    body.update({"messages": messages} if kind == "chat" else {"prompt": prompt})
    async with httpx.AsyncClient(base_url=backend.url, timeout=60) as c:
        whole = (await c.post(path, json=body)).json()
        streamed = ""
        async with c.stream("POST", path, json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    ch = json.loads(line[6:])["choices"][0]
                    streamed += (ch["delta"].get("content") or "") if kind == "chat" else ch["text"]
    got = whole["choices"][0]
    assert (got["message"]["content"] if kind == "chat" else got["text"]) == text
    assert whole["usage"]["completion_tokens"] == n
    assert whole["usage"]["prompt_tokens"] == len(ids)
    assert got["finish_reason"] == reason
    assert streamed == text
