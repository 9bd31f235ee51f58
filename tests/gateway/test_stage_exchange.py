"""The staged request path end to end, in memory: a real ``Gateway`` from ``build_gateway``
whose pool members answer from scripts (no server). Each test checks what the client got,
the ``Ended`` record (one outcome for ledger, metrics and trace) and that nothing is left
held: no lease, no reservation, no capacity slot, no member load."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from gateway.exchange import Exchange
from gateway.http_client import ConnectFailed
from gateway.outcome import Outcome
from gateway.service import Gateway
from gateway.tenants import Tenant
from gateway.timing import RequestTimes
from tests.gateway.stage_kit import (
    Client,
    Scripted,
    chunk,
    config,
    gateway,
    reply,
    sse,
)
from tests.gateway.stage_kit import quota_tenant as tenant

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
USAGE = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
STREAM = sse(chunk("a"), chunk("b"), chunk(None, finish="stop"), chunk(None, usage=USAGE),
             "[DONE]")


async def run(gw: Gateway, body: dict[str, Any], who: Tenant | None = None
              ) -> tuple[Exchange, Client]:
    client = Client()
    ex = Exchange(gw, "chat", who or tenant(), reply(client, gw.metrics), RequestTimes(0.0))
    await ex.run(body, None)
    return ex, client


async def nothing_held(gw: Gateway) -> None:
    """Every lease, reservation and slot given back (their releases run in owned tasks)."""
    for _ in range(200):
        await asyncio.sleep(0)
        if not gw.admission.live and not gw.admission._settling and all(
                q.snapshot().slots_held == 0 for q in gw.queues.values()):
            break
    assert not gw.admission.live
    assert all(q.snapshot().slots_held == 0 and q.snapshot().size == 0
               for q in gw.queues.values())
    assert all(m.inflight_requests == 0 and m.inflight_tokens == 0
               for up in gw.upstreams.values() for m in up.members)
    usage = await gw.admission.store.usage("one")
    assert usage["concurrency"] == 0 and usage["reserved"]["day"] == 0  # all settled


async def test_a_streamed_answer_settles_once_at_its_actual_cost() -> None:
    gw = gateway(config(), {"http://m0": [Scripted(chunks=[STREAM])]})
    ex, client = await run(gw, {**CHAT, "stream": True})
    assert client.status == 200 and client.body.endswith(b"data: [DONE]\n\n")
    ended = ex.ended
    assert ended is not None and ended.outcome is Outcome.SUCCESS and ended.reserved
    assert ended.tokens() == (4, 2, True) and ended.queued_s == 0.0
    assert gw.ledger.by_key == {("one", "m", "success"): 1}
    assert gw.ledger.by_tenant["one"].completion_tokens == 2
    await nothing_held(gw)
    assert (await gw.admission.store.usage("one"))["settled"]["day"] == 6  # 4 + 2, not 4 + 8


async def test_a_quota_refusal_is_a_429_with_nothing_reserved_or_settled() -> None:
    gw = gateway(config(), {"http://m0": [Scripted(chunks=[STREAM])]})
    ex, client = await run(gw, CHAT, tenant(tokens_per_minute=3))
    assert client.status == 429 and b"retry-after" not in client.headers  # can never fit
    assert ex.ended is not None and ex.ended.outcome is Outcome.REJECTED_429
    assert not ex.ended.reserved and gw.ledger.by_key == {}
    assert gw.upstreams["m"].members[0].pool.posts == []  # type: ignore[attr-defined]
    await nothing_held(gw)


async def test_a_failed_server_is_retried_on_the_other_and_the_slot_moves() -> None:
    # one script for both servers: whichever is called first fails, the other answers
    answers = [Scripted(fail=ConnectFailed("refused")), Scripted(chunks=[STREAM])]
    gw = gateway(config("http://a", "http://b", capacity={"max_seqs": 4}),
                 {"http://a": answers, "http://b": answers})
    members = gw.upstreams["m"].members
    for m in members:  # at each post: the slots each member's queue holds
        m.pool.probe = lambda: {k: q.snapshot().slots_held  # type: ignore[attr-defined]
                                for k, q in gw.queues.items()}
    ex, client = await run(gw, {**CHAT, "stream": True})
    assert client.status == 200 and ex.ended is not None
    assert ex.ended.outcome is Outcome.SUCCESS
    assert gw.metrics.retries == {("m", "retried"): 1}
    # each post held exactly one slot, on its own member: the failed member's slot was
    # given back before the retry took one on the other
    for m in members:
        assert m.pool.probed == [  # type: ignore[attr-defined]
            {k: int(k == m.key) for k in gw.queues}]
    await nothing_held(gw)


async def test_a_client_leaving_mid_stream_is_cancelled_and_settles_what_ran() -> None:
    hold = asyncio.Event()
    gw = gateway(config(), {"http://m0": [Scripted(chunks=[sse(chunk("a")), STREAM],
                                                   hold=hold)]})
    client = Client()
    ex = Exchange(gw, "chat", tenant(), reply(client, gw.metrics), RequestTimes(0.0))
    task = asyncio.ensure_future(ex.run({**CHAT, "stream": True}, None))
    for _ in range(100):
        await asyncio.sleep(0)
        if client.status == 200:
            break
    assert client.status == 200  # the stream began; the upstream holds its first event
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ex.ended is not None and ex.ended.outcome is Outcome.CANCELLED
    assert gw.ledger.by_key == {("one", "m", "cancelled"): 1}
    pool = gw.upstreams["m"].members[0].pool
    assert pool.responses[0].closed  # type: ignore[attr-defined]
    await nothing_held(gw)


async def test_the_deadline_ends_the_call_with_a_504() -> None:
    hold = asyncio.Event()  # never set: the upstream never answers
    gw = gateway(config(), {"http://m0": [Scripted(chunks=[STREAM], hold=hold)]})
    ex, client = await run(gw, {**CHAT, "stream": True, "deadline_ms": 50})
    assert client.status == 200  # headers went out; the error is an event in the stream
    assert b'"code":"deadline_exceeded"' in client.body.replace(b" ", b"")
    assert ex.ended is not None and ex.ended.outcome is Outcome.DEADLINE
    await nothing_held(gw)


async def test_a_whole_answer_and_an_invalid_body() -> None:
    answer = {"id": "x", "object": "chat.completion", "model": "fake-model",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "hey"},
                           "finish_reason": "stop"}], "usage": USAGE}
    gw = gateway(config(), {"http://m0": [Scripted(chunks=[json.dumps(answer).encode()])]})
    ex, client = await run(gw, CHAT)
    assert client.status == 200 and json.loads(client.body)["model"] == "m"
    assert ex.ended is not None and ex.ended.outcome is Outcome.SUCCESS
    bad, client = await run(gw, {**CHAT, "max_tokens": "8"})
    assert client.status == 400 and bad.ended is not None
    assert bad.ended.outcome is Outcome.INVALID and bad.ended.prepared is None
    await nothing_held(gw)
