"""Real upstreams that write SSE other than plain LF, relayed through the gateway to the
official ``openai`` SDK: CRLF line ends cut at awkward byte boundaries (a CRLF split between
two reads, a UTF-8 character or the BOM split too), and ``sse-starlette`` (CRLF, comment
pings, ``id:`` and ``retry:`` fields, multi-line data). Each must arrive whole, with the
upstream's usage, and settle as a success."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Self

import httpx
import openai
import pytest
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.uvicorn_thread import UvicornThread

from .conftest import TEST_KEY, ThreadedGateway, config_for, tenants_for_tests
from .stage_kit import VERSIONS

UPSTREAM_MODEL = "fake-model"
PIECES = ["Hél", "lo, ", "wörld", " 🙂", "!"]  # multi-byte characters to cut through
USAGE = {"prompt_tokens": 9, "completion_tokens": len(PIECES),
         "total_tokens": 9 + len(PIECES)}
BOM = b"\xef\xbb\xbf"


def chunks(usage_asked: bool) -> list[dict[str, Any]]:
    """An OpenAI chat-completions stream: content chunks, a finish, the usage chunk."""
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
            "model": UPSTREAM_MODEL, "system_fingerprint": "fp_up"}
    out = [{**base, "choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]}
           for p in PIECES]
    out.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    if usage_asked:
        for c in out:
            c["usage"] = None
        out.append({**base, "choices": [], "usage": USAGE})
    return out


Stream = Callable[[list[dict[str, Any]]], Response]


class Upstream:
    """An OpenAI-compatible server on 127.0.0.1 whose chat stream ``stream`` writes."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.http = UvicornThread(Starlette(routes=[
            Route("/v1/models", self._models),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
        ]), "the upstream")
        self.url = self.http.url

    def __enter__(self) -> Self:
        self.http.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.stop()

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": UPSTREAM_MODEL, "object": "model", "max_model_len": 4096}]})

    async def _chat(self, request: Request) -> Response:
        body = await request.json()
        assert body["stream"] is True
        return self.stream(chunks(bool((body.get("stream_options") or {})
                                       .get("include_usage"))))


def awkward_cuts(raw: bytes) -> list[bytes]:
    """``raw`` in pieces cut between every CR and its LF, inside the BOM, inside every
    multi-byte UTF-8 character, and every 37 bytes."""
    cuts = {1, 2} | set(range(37, len(raw), 37))
    cuts |= {i for i in range(1, len(raw)) if raw[i - 1:i + 1] == b"\r\n"}
    cuts |= {i for i in range(1, len(raw)) if 0x80 <= raw[i] < 0xC0}  # a continuation byte
    points = [0, *sorted(c for c in cuts if 0 < c < len(raw)), len(raw)]
    return [raw[a:b] for a, b in itertools.pairwise(points)]


def crlf_stream(bom: bool, linger_s: float = 0.0) -> Stream:
    def stream(events: list[dict[str, Any]]) -> Response:
        raw = b"".join(b"data: " + json.dumps(e, ensure_ascii=False).encode() + b"\r\n\r\n"
                       for e in events)
        pieces = [*awkward_cuts(BOM + raw if bom else raw), b"data: [DONE]\r\n\r\n"]

        async def body() -> AsyncIterator[bytes]:
            for piece in pieces:
                await asyncio.sleep(0.004)  # one read each at the gateway, as far as it can
                yield piece
            # an upstream that ends its body a while after [DONE]: the client, which
            # leaves at [DONE], has its answer whole by then (settled as a success)
            await asyncio.sleep(linger_s)

        return StreamingResponse(body(), media_type="text/event-stream")
    return stream


def sse_starlette_stream(events: list[dict[str, Any]]) -> Response:
    async def body() -> AsyncIterator[ServerSentEvent]:
        yield ServerSentEvent(retry=3000)  # "retry: 3000" alone: an event without data
        for i, e in enumerate(events):
            await asyncio.sleep(0.03)  # long enough for comment pings in between
            # indented JSON: sse-starlette writes each of its lines as a data: line
            yield ServerSentEvent(json.dumps(e, indent=1 if i == 2 else None), id=str(i))
        yield ServerSentEvent("[DONE]")

    return EventSourceResponse(body(), ping=0.01)  # sep: CRLF, its default


@pytest.fixture(params=[
    pytest.param(crlf_stream(False), id="crlf-awkward-cuts"),
    pytest.param(crlf_stream(True), id="crlf-awkward-cuts-bom"),
    pytest.param(crlf_stream(False, linger_s=2.0), id="crlf-lingers-after-done"),
    pytest.param(sse_starlette_stream, id="sse-starlette"),
])
def gateway(request: pytest.FixtureRequest) -> Iterator[ThreadedGateway]:
    with Upstream(request.param) as up, ThreadedGateway(
            config_for(up.url, kind="openai", tokenizer="bytes", upstream_model=UPSTREAM_MODEL,
                       versions=VERSIONS), tenants_for_tests()) as g:
        yield g


def settled(g: ThreadedGateway, n: int) -> None:
    ledger = g.gateway.ledger
    deadline = time.monotonic() + 5
    while ledger.by_key.get(("one", "m", "success"), 0) < n:
        assert time.monotonic() < deadline, ledger.by_key
        time.sleep(0.01)
    assert set(ledger.by_key) == {("one", "m", "success")}
    assert ledger.by_tenant["one"].prompt_tokens == n * USAGE["prompt_tokens"]
    assert ledger.by_tenant["one"].completion_tokens == n * USAGE["completion_tokens"]


def test_the_openai_sdk_gets_the_whole_stream(gateway: ThreadedGateway) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=TEST_KEY, max_retries=0,
                           timeout=30)
    got = list(client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True}))
    content = "".join(c.choices[0].delta.content or "" for c in got if c.choices)
    assert content == "".join(PIECES)
    assert [c.choices[0].finish_reason for c in got if c.choices][-1] == "stop"
    assert {c.model for c in got} == {"m"}
    last = got[-1]
    assert not last.choices and last.usage is not None
    assert last.usage.model_dump(exclude_none=True) == USAGE
    assert all(c.usage is None for c in got[:-1])
    settled(gateway, 1)


def test_the_client_gets_lf_events_with_data_and_comments_only(
        gateway: ThreadedGateway, request: pytest.FixtureRequest) -> None:
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", timeout=30,
                      headers={"authorization": f"Bearer {TEST_KEY}"},
                      json={"model": "m", "stream": True,
                            "messages": [{"role": "user", "content": "hi"}]}) as resp:
        assert resp.status_code == 200
        raw = resp.read()
    assert b"\r" not in raw and not raw.startswith(BOM) and raw.endswith(b"\n\n")
    events = raw[:-2].split(b"\n\n")
    assert events[-1] == b"data: [DONE]"
    comments = [e for e in events if e.startswith(b":")]
    assert all(c.startswith(b": ping - ") and b"\n" not in c for c in comments)
    if request.node.callspec.params["gateway"] is sse_starlette_stream:
        assert comments  # its keep-alive pings reach the client
    data = [e for e in events if not e.startswith(b":")]
    assert all(e.startswith(b"data: {") and b"\n" not in e for e in data[:-1]), events
    relayed = [json.loads(e[6:]) for e in data[:-1]]
    assert len(relayed) == len(PIECES) + 1  # the usage chunk is not the client's to see
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in relayed) \
        == "".join(PIECES)
    settled(gateway, 1)
