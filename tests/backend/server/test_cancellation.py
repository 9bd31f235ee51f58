"""A client that goes away aborts its engine request at once: running, waiting, streamed
or not. Raw sockets, so that the moment of disconnect is ours to choose."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import Backend, start_backend

LONG = 1500  # far more tokens than a test waits for: only an abort ends these requests


@pytest.fixture(scope="module")
def wide(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    b = start_backend(tmp_path_factory.mktemp("wide"))
    yield b
    b.stop()


@pytest.fixture(scope="module")
def narrow(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    """One sequence at a time, so that further requests wait in the engine queue."""
    b = start_backend(tmp_path_factory.mktemp("narrow"), "--max-num-seqs", "1")
    yield b
    b.stop()


class RawClient:
    """A raw socket, so that the moment of disconnect is the test's to choose."""

    def __init__(self, port: int, headers: bytes = b"") -> None:
        self.port = port
        self.headers = headers  # extra header lines, each ending in CRLF
        self.writer: asyncio.StreamWriter | None = None

    async def send(self, path: str, body: dict) -> asyncio.StreamReader:
        reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        data = json.dumps(body).encode()
        self.writer.write(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"%scontent-length: %d\r\n\r\n%s"
                          % (path.encode(), self.headers, len(data), data))
        await self.writer.drain()
        return reader

    async def read_events(self, reader: asyncio.StreamReader, n: int) -> None:
        """Until n events with content (the chat role chunk does not count)."""
        seen = 0
        while seen < n:
            line = await asyncio.wait_for(reader.readline(), 30)
            assert line, "server closed early"
            if line.startswith(b"data: {") and b'"content":""' not in line:
                seen += 1

    def disconnect(self) -> None:
        assert self.writer is not None
        self.writer.transport.abort()  # RST: as abrupt as a killed client


def stream_body(max_tokens: int = LONG) -> dict:
    return {"messages": [{"role": "user", "content": "Talk for a long time."}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True}


async def wait_state(backend: Backend, pred, timeout: float) -> dict:
    """Poll /v1/state until pred(state); returns it, or fails with the last one."""
    deadline = time.monotonic() + timeout
    while True:
        state = await asyncio.to_thread(backend.state)
        if pred(state):
            return state
        if time.monotonic() > deadline:
            pytest.fail(f"state did not settle in {timeout}s: {state}")
        await asyncio.sleep(0.02)


def all_free(s: dict) -> bool:
    return s["kv_blocks_free"] == s["kv_blocks_total"] and s["running"] == 0 and s["waiting"] == 0


async def test_fifty_streaming_clients_disconnect_mid_generation(wide: Backend) -> None:
    before = wide.state()
    clients = [RawClient(wide.port) for _ in range(50)]
    readers = await asyncio.gather(*(c.send("/v1/chat/completions", stream_body())
                                     for c in clients))
    await asyncio.gather(*(c.read_events(r, 3) for c, r in zip(clients, readers)))
    mid = wide.state()
    assert mid["running"] == 50
    assert mid["kv_blocks_free"] < mid["kv_blocks_total"]
    for c in clients:
        c.disconnect()
    t0 = time.monotonic()
    after = await wait_state(wide, all_free, timeout=1.0)
    assert time.monotonic() - t0 <= 1.0
    assert after["aborted"] - before["aborted"] == 50
    assert after["max_tokens_after_abort"] <= 2
    assert after["generated_tokens"] - mid["generated_tokens"] < 50 * 20


async def test_non_streaming_disconnect_aborts(wide: Backend) -> None:
    before = wide.state()
    c = RawClient(wide.port)
    await c.send("/v1/completions", {"prompt": "go on", "max_tokens": LONG, "ignore_eos": True})
    await wait_state(wide, lambda s: s["running"] == 1 and s["generated_tokens"]
                     > before["generated_tokens"], timeout=10)
    c.disconnect()
    after = await wait_state(wide, all_free, timeout=1.0)
    assert after["aborted"] == before["aborted"] + 1
    assert after["max_tokens_after_abort"] <= 2


async def test_disconnect_while_waiting_in_engine_queue(narrow: Backend) -> None:
    before = narrow.state()
    runner = RawClient(narrow.port)
    r = await runner.send("/v1/chat/completions", stream_body())
    await runner.read_events(r, 2)
    waiters = [RawClient(narrow.port) for _ in range(6)]
    for i, w in enumerate(waiters):
        if i % 2:
            await w.send("/v1/completions", {"prompt": "wait", "max_tokens": 50})
        else:
            await w.send("/v1/chat/completions", stream_body(50))
    await wait_state(narrow, lambda s: s["waiting"] == 6 and s["running"] == 1, timeout=10)
    for w in waiters:
        w.disconnect()
    mid = await wait_state(narrow, lambda s: s["waiting"] == 0, timeout=1.0)
    assert mid["running"] == 1  # the running request is untouched
    assert mid["aborted"] == before["aborted"] + 6
    await runner.read_events(r, 2)  # and it still streams
    runner.disconnect()
    after = await wait_state(narrow, all_free, timeout=1.0)
    assert after["aborted"] == before["aborted"] + 7
    assert after["max_tokens_after_abort"] <= 2
