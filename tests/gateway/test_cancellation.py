"""Cancellation end to end: a client that leaves the gateway, at any stage, frees its KV
blocks in the bundled backend at once, and its usage is settled as cancelled."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.backend.server.test_cancellation import RawClient

from .conftest import ALPHA, SluiceUp, start_sluice_up

LONG = 1000  # far more tokens than the test waits for: only an abort ends these requests
# One sequence alone runs faster (1000 tokens in under a second here): a lone request asks
# for nearly all of the tiny model's 2048 positions.
LONGEST = 2000
CLIENTS = 50
RACING_WAITERS = 4  # at most this many queued requests woken as their clients all leave


@pytest.fixture(scope="module")
def narrow(tmp_path_factory: pytest.TempPathFactory, sluice_up: SluiceUp) -> Iterator[SluiceUp]:
    """One engine sequence at a time: the other requests wait in the gateway's queue."""
    up = start_sluice_up(tmp_path_factory.mktemp("narrow"), "--max-num-seqs", "1")
    yield up
    up.stop()


def raw_client(up: SluiceUp) -> RawClient:
    return RawClient(int(up.url.rsplit(":", 1)[1]),
                     b"authorization: Bearer " + ALPHA.encode() + b"\r\n")


CHAT_PATH = "/v1/chat/completions"


def body(i: int, max_tokens: int = LONG) -> dict[str, Any]:
    return {"model": "sluice-tiny", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": f"Client {i}: talk for a long time."}]}


async def wait_state(up: SluiceUp, pred: Callable[[dict[str, Any]], bool],
                     timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        state = await asyncio.to_thread(up.backend_state)
        if pred(state):
            return state
        if time.monotonic() > deadline:
            pytest.fail(f"the backend did not settle in {timeout}s: {state}")
        await asyncio.sleep(0.02)


def all_free(s: dict[str, Any]) -> bool:
    return s["kv_blocks_free"] == s["kv_blocks_total"] and s["running"] == 0 \
        and s["waiting"] == 0


def backend_requests(up: SluiceUp, outcome: str = r"[^\"]*") -> int:
    """Requests that reached the engine and ended with ``outcome`` (a regex; default: any),
    the backend's own count."""
    text = httpx.get(up.backend_url + "/metrics", headers=up.backend_headers, timeout=5).text
    assert "# TYPE sluice_backend_requests_total counter" in text
    return sum(int(float(n)) for n in re.findall(
        r'^sluice_backend_requests_total\{[^}]*outcome="' + outcome + r'"[^}]*\} (\S+)$',
        text, re.MULTILINE))


def backend_successes(up: SluiceUp) -> int:
    """Requests the engine ran to completion."""
    return backend_requests(up, "success")


async def wait_aborted(up: SluiceUp, successes_before: int) -> None:
    """Every block free again, and not by completion: none of the LONG generations ran to
    its end, so each was aborted. (A bounded wait, not a timed assert: a loaded machine
    may take a while, but without the abort each request would hold its blocks for
    LONG tokens and finish as a success.)"""
    await wait_state(up, all_free, 30)
    assert backend_successes(up) == successes_before


def cancelled_count(up: SluiceUp) -> int:
    text = up.metrics()
    return sum(int(float(n)) for n in re.findall(
        r'sluice_gateway_requests_settled_total\{[^}]*outcome="cancelled"[^}]*\} (\S+)', text))


def queued(up: SluiceUp) -> int:
    m = re.search(r'^sluice_gateway_queue_length\{model="sluice-tiny"\} (\S+)$', up.metrics(),
                  re.MULTILINE)
    assert m
    return int(float(m.group(1)))


def inflight(up: SluiceUp) -> int:
    m = re.search(r"^sluice_gateway_inflight_requests (\S+)$", up.metrics(), re.MULTILINE)
    assert m
    return int(float(m.group(1)))


async def test_fifty_clients_leaving_mid_generation_free_every_block(
        sluice_up: SluiceUp) -> None:
    await wait_state(sluice_up, all_free, 30)
    before, successes = cancelled_count(sluice_up), backend_successes(sluice_up)
    clients = [raw_client(sluice_up) for _ in range(CLIENTS)]
    readers = await asyncio.gather(*(c.send(CHAT_PATH, body(i)) for i, c in enumerate(clients)))
    # every stream has produced tokens: all 50 are mid-generation in the engine
    await asyncio.gather(*(c.read_events(r, 3) for c, r in zip(clients, readers)))
    state = sluice_up.backend_state()
    assert state["running"] == CLIENTS and state["kv_blocks_free"] < state["kv_blocks_total"]
    for c in clients:
        c.disconnect()
    await wait_aborted(sluice_up, successes)
    deadline = time.monotonic() + 5
    while cancelled_count(sluice_up) - before < CLIENTS and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert cancelled_count(sluice_up) - before == CLIENTS
    assert inflight(sluice_up) == 0


async def test_clients_leaving_before_the_first_token_free_every_block(
        narrow: SluiceUp) -> None:
    await wait_state(narrow, all_free, 30)
    before, successes = cancelled_count(narrow), backend_successes(narrow)
    reached = backend_requests(narrow)
    clients = [raw_client(narrow) for _ in range(CLIENTS)]
    await asyncio.gather(*(c.send(CHAT_PATH, body(i, LONGEST))
                           for i, c in enumerate(clients)))
    # One runs; the rest wait in the gateway's queue, since the backend has room for one
    # sequence (its capacity gate). None of those has sent a token.
    await wait_state(narrow, lambda s: s["running"] == 1, 30)
    deadline = time.monotonic() + 30
    while queued(narrow) < CLIENTS - 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert queued(narrow) == CLIENTS - 1
    for c in clients:
        c.disconnect()
    await wait_state(narrow, all_free, 30)
    assert queued(narrow) == 0  # every waiting entry left with its client
    # The queued requests left the gateway's queue with their clients: they never reach the
    # engine, but for a waiter woken by the running one's abort in the few loop turns
    # before its own client's disconnect is read (it is aborted at once). Were waiters
    # dispatched after their clients left, all 49 would reach the engine. The running one
    # is aborted, unless this tiny engine ran its LONGEST tokens (a second or two) before
    # its client's disconnect reached it: then it is a success, and the only one.
    deadline = time.monotonic() + 5  # the running one's outcome, counted as it ends
    while backend_requests(narrow) == reached and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert 1 <= backend_requests(narrow) - reached <= RACING_WAITERS + 1
    finished = backend_successes(narrow) - successes
    assert finished in (0, 1)
    deadline = time.monotonic() + 5
    while cancelled_count(narrow) - before < CLIENTS - finished \
            and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert cancelled_count(narrow) - before == CLIENTS - finished
    assert inflight(narrow) == 0


async def test_a_client_leaving_during_a_whole_answer_aborts_it(sluice_up: SluiceUp) -> None:
    await wait_state(sluice_up, all_free, 30)
    successes = backend_successes(sluice_up)
    c = raw_client(sluice_up)
    await c.send(CHAT_PATH, {**body(0, LONGEST), "stream": False})
    await wait_state(sluice_up, lambda s: s["running"] == 1, 30)
    c.disconnect()
    await wait_aborted(sluice_up, successes)


def test_a_finished_stream_leaves_nothing_behind(sluice_up: SluiceUp) -> None:
    with httpx.stream("POST", sluice_up.url + "/v1/chat/completions",
                      headers={"authorization": f"Bearer {ALPHA}"},
                      json={**body(1), "max_tokens": 5}, timeout=60) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert backend_successes(sluice_up) >= 1  # the count the abort checks rely on works
    state = sluice_up.backend_state()
    assert all_free(state), state
    assert inflight(sluice_up) == 0
