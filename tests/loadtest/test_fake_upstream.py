"""`sluice fake-upstream`: the instant OpenAI-compatible upstream of the overhead bench."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httptools
import httpx
import openai
import pytest

from loadtest.fake_upstream import FakeSettings, FakeUpstream, start_fake_upstream

REPO_ROOT = Path(__file__).resolve().parents[2]
CHUNKS = 7
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a river."}]
PROMPT_BYTES = len("Be brief.") + len("Name a river.")


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    server = await start_fake_upstream("127.0.0.1", 0, chunks=CHUNKS, model="listed")
    yield server
    await server.close()


@pytest.fixture
async def client(upstream: FakeUpstream) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=upstream.base_url, api_key="unused",
                                  max_retries=0, timeout=10) as sdk:
        yield sdk


async def test_chat_stream_without_usage(upstream: FakeUpstream,
                                         client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(model="m1", messages=MESSAGES,
                                                         max_tokens=20, stream=True)
    chunks = [c async for c in stream]
    assert len(chunks) == CHUNKS
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.content for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (CHUNKS - 1) + ["stop"]
    assert {c.model for c in chunks} == {"m1"}
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert {c.system_fingerprint for c in chunks} == {"fp_fake"}
    assert len({c.id for c in chunks}) == 1
    assert all(c.usage is None for c in chunks)


async def test_chat_stream_with_usage(upstream: FakeUpstream,
                                      client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="m2", messages=MESSAGES, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert len(chunks) == CHUNKS + 1
    *content, last = chunks
    assert all(len(c.choices) == 1 and c.usage is None for c in content)
    assert content[-1].choices[0].finish_reason == "stop"
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == PROMPT_BYTES // 4 + 1
    assert last.usage.completion_tokens == CHUNKS
    assert last.usage.total_tokens == PROMPT_BYTES // 4 + 1 + CHUNKS
    # The raw stream marks "usage": null on content chunks and ends with [DONE].
    async with httpx.AsyncClient() as http:
        r = await http.post(upstream.base_url + "/chat/completions", json={
            "model": "m2", "messages": MESSAGES, "stream": True,
            "stream_options": {"include_usage": True}})
    assert r.headers["content-type"] == "text/event-stream"
    assert r.headers["transfer-encoding"] == "chunked"
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert all('"usage":null' in e for e in events[:CHUNKS])


async def test_chat_non_stream(upstream: FakeUpstream,
                               client: openai.AsyncOpenAI) -> None:
    out = await client.chat.completions.create(model="m3", messages=MESSAGES)
    assert out.object == "chat.completion" and out.model == "m3"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content and out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.completion_tokens == CHUNKS
    assert out.usage.prompt_tokens == PROMPT_BYTES // 4 + 1


async def test_completions_stream_and_not(upstream: FakeUpstream,
                                          client: openai.AsyncOpenAI) -> None:
    stream = await client.completions.create(model="m4", prompt="abcdefghij", stream=True,
                                             stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert len(chunks) == CHUNKS + 1
    assert all(c.object == "text_completion" and c.choices[0].text for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 10 // 4 + 1
    out = await client.completions.create(model="m4", prompt=[1, 2, 3])
    assert out.choices[0].text == "".join(c.choices[0].text for c in chunks[:-1])
    assert out.usage is not None and out.usage.prompt_tokens == 3
    assert out.usage.total_tokens == 3 + CHUNKS


async def test_models_and_health(upstream: FakeUpstream,
                                 client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == ["listed"]
    async with httpx.AsyncClient() as http:
        r = await http.get(f"http://127.0.0.1:{upstream.port}/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


async def test_bad_json_is_a_400_in_openai_error_shape(upstream: FakeUpstream,
                                                       client: openai.AsyncOpenAI) -> None:
    async with httpx.AsyncClient() as http:
        r = await http.post(upstream.base_url + "/chat/completions", content=b'{"model": ',
                            headers={"content-type": "application/json"})
        assert r.status_code == 400
        error = r.json()["error"]
        assert set(error) == {"message", "type", "code", "param"}
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_json"
        r = await http.post(upstream.base_url + "/completions", json={"prompt": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = await http.get(upstream.base_url + "/chat/completions")
        assert r.status_code == 405
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model="m", prompt=[{"x": 1}])  # type: ignore


class _Responses:
    """httptools callbacks collecting whole responses (status, decoded body) in order."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[tuple[int, bytes]] = []
        self.body = b""

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.done.append((self.parser.get_status_code(), self.body))
        self.body = b""


async def _read_responses(reader: asyncio.StreamReader, responses: _Responses,
                          n: int) -> list[tuple[int, bytes]]:
    while len(responses.done) < n:
        data = await reader.read(65536)
        assert data, "the server closed the connection"
        responses.parser.feed_data(data)
    out, responses.done = responses.done[:n], responses.done[n:]
    return out


def _post(path: bytes, body: dict[str, Any]) -> bytes:
    raw = json.dumps(body).encode()
    return (b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
            % (path, len(raw), raw))


@pytest.mark.parametrize("delay_ms", [0.0, 2.0])
async def test_one_connection_serves_sequential_and_pipelined_requests(delay_ms: float) -> None:
    async with FakeUpstream(settings=FakeSettings(chunks=3, delay_ms=delay_ms)) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        responses = _Responses()
        stream = _post(b"/v1/chat/completions", {"messages": [], "stream": True})
        for _ in range(3):  # keep-alive: one after the other
            writer.write(stream)
            ((status, body),) = await _read_responses(reader, responses, 1)
            assert status == 200 and body.count(b"data: ") == 4
            assert body.endswith(b"data: [DONE]\n\n")
        # Pipelined: three requests in one write come back in order on the same connection.
        writer.write(_post(b"/v1/completions", {"prompt": "a", "model": "first"})
                     + stream + b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        first, second, third = await _read_responses(reader, responses, 3)
        assert first[0] == 200 and json.loads(first[1])["model"] == "first"
        assert second[0] == 200 and second[1].count(b"data: ") == 4
        assert third == (200, b'{"status":"ok"}')
        assert len(server.connections) == 1
        writer.close()
        await writer.wait_closed()


async def test_client_leaving_mid_stream_is_quiet() -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    async with FakeUpstream(settings=FakeSettings(chunks=50, delay_ms=5)) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(_post(b"/v1/chat/completions", {"messages": [], "stream": True}))
        await reader.readuntil(b"data: ")
        writer.transport.abort()
        for _ in range(100):
            if not server.connections:
                break
            await asyncio.sleep(0.01)
        assert not server.connections
        await asyncio.sleep(0.05)  # past the next scheduled chunk
        # The server still answers new connections.
        async with httpx.AsyncClient() as http:
            r = await http.get(f"http://127.0.0.1:{server.port}/health")
        assert r.status_code == 200
    assert errors == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_cli_starts_answers_and_stops_on_sigterm() -> None:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice.cli", "fake-upstream", "--port", str(port),
         "--chunks", "4", "--model", "cli-model"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == f"fake upstream ready at http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=10)
        assert [m.id for m in client.models.list().data] == ["cli-model"]
        stream = client.chat.completions.create(model="x", messages=MESSAGES, stream=True)
        assert len(list(stream)) == 4
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert err == ""
