"""`sluice backend --speculative ngram` over HTTP: concurrent greedy answers equal the
plain server's, streamed and not; the state, metrics and versions report speculation; a
request may opt out."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from .conftest import Backend, start_backend

PROMPTS = [f"the {w} and the {w} and the {w} and the" for w in
           ("sea", "wind", "river", "stone", "bird", "tree", "road", "hill")]


@pytest.fixture(scope="module")
def spec_backend(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    b = start_backend(tmp_path_factory.mktemp("spec"), "--speculative", "ngram",
                      "--speculative-max-batch", "16")
    yield b
    b.stop()


async def answers(url: str, stream: bool, extra: dict | None = None) -> list[tuple[str, list]]:
    """Every prompt at once (one batch), greedy; text and logprob tokens of each."""
    async def one(c: httpx.AsyncClient, prompt: str) -> tuple[str, list]:
        body = {"prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
                "logprobs": 1, **(extra or {})}
        if not stream:
            ch = (await c.post("/v1/completions", json=body)).json()["choices"][0]
            return ch["text"], ch["logprobs"]["tokens"]
        text, toks = "", []
        async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    ch = json.loads(line[6:])["choices"][0]
                    text += ch["text"]
                    toks += (ch.get("logprobs") or {}).get("tokens") or []
        return text, toks

    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        return await asyncio.gather(*(one(c, p) for p in PROMPTS))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_concurrent_greedy_answers_equal_the_plain_server(backend: Backend,
                                                         spec_backend: Backend,
                                                         stream: bool) -> None:
    before = spec_backend.state()["spec_accepted_tokens"]
    plain = asyncio.run(answers(backend.url, stream))
    spec = asyncio.run(answers(spec_backend.url, stream))
    assert spec == plain
    assert all(len(toks) == 48 for _, toks in spec)
    assert spec_backend.state()["spec_accepted_tokens"] > before


def test_state_metrics_and_versions_report_speculation(spec_backend: Backend) -> None:
    asyncio.run(answers(spec_backend.url, False))
    st = spec_backend.state()
    assert st["spec_proposed_tokens"] >= st["spec_accepted_tokens"] > 0
    assert 0 < st["spec_acceptance_rate"] <= 1 and st["spec_tokens_per_step"] > 1
    assert st["resolved"]["engine"].endswith("+spec-ngram-k4-b16")
    text = httpx.get(spec_backend.url + "/metrics").text
    for name in ("spec_decode_draft_tokens_total", "spec_decode_accepted_tokens_total",
                 "spec_decode_acceptance_rate", "spec_decode_tokens_per_step"):
        line = [ln for ln in text.splitlines() if ln.startswith(f"sluice_backend_{name} ")]
        assert line and float(line[0].split()[-1]) > 0, name
    r = httpx.post(spec_backend.url + "/v1/completions",
                   json={"prompt": PROMPTS[0], "max_tokens": 2})
    assert "+spec-ngram-k4-b16" in r.headers["x-sluice-resolved"]


def test_a_request_may_opt_out(backend: Backend, spec_backend: Backend) -> None:
    before = spec_backend.state()["spec_proposed_tokens"]
    off = asyncio.run(answers(spec_backend.url, False, {"speculative": False}))
    assert spec_backend.state()["spec_proposed_tokens"] == before
    assert off == asyncio.run(answers(backend.url, False))
    bad = httpx.post(spec_backend.url + "/v1/completions",
                     json={"prompt": "x", "max_tokens": 2, "speculative": "no"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative"


def test_a_bad_speculative_flag_stops_start_up(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="speculative"):
        start_backend(tmp_path, "--speculative", "medusa", ready_timeout=60)
