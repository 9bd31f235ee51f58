"""``bounded_send``: the stall timer only where a send can wait (uvicorn's flow control)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest
import uvicorn

from gateway.client_io import ClientStalled
from gateway.endpoint import bounded_send
from tests.backend.server.conftest import free_port


class _Flow:
    def __init__(self) -> None:
        self.write_paused = False


class _Cycle:
    """uvicorn's shape: ``send`` is a method of an object with ``flow.write_paused``."""

    def __init__(self) -> None:
        self.flow = _Flow()
        self.sent: list[dict[str, Any]] = []
        self.release = asyncio.Event()

    async def send(self, message: dict[str, Any]) -> None:
        if self.flow.write_paused:
            await self.release.wait()  # what uvicorn's flow.drain() does
        self.sent.append(message)


async def test_a_paused_transport_gets_the_stall_timer() -> None:
    cycle = _Cycle()
    send = bounded_send(cycle.send, 0.05)
    assert getattr(send, "watches_flow", False)
    await send({"n": 1})
    cycle.flow.write_paused = True
    with pytest.raises(ClientStalled):
        await send({"n": 2})
    assert cycle.sent == [{"n": 1}]
    cycle.release.set()  # drained in time: no stall
    await send({"n": 3})
    assert cycle.sent == [{"n": 1}, {"n": 3}]


async def test_a_server_without_flow_control_gets_the_timer_on_every_message() -> None:
    never = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        await never.wait()

    bounded = bounded_send(send, 0.05)
    assert not getattr(bounded, "watches_flow", False)
    with pytest.raises(ClientStalled):
        await bounded({"type": "http.response.body"})


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_uvicorn_sends_take_the_flow_control_path(http: str) -> None:
    """Guards the fast path against a uvicorn change: its ``send`` still exposes the flag."""
    seen: list[bool] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        bounded = bounded_send(send, 5.0)
        seen.append(bool(getattr(bounded, "watches_flow", False)))
        await bounded({"type": "http.response.start", "status": 200, "headers": []})
        await bounded({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=http,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).text == "ok"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert seen == [True]
