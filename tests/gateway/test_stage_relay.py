"""The relay stage alone: one attempt's upstream answer turned into the client's, and the
frozen ``RelayResult`` that settlement reads, from scripted upstream answers (no server)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.contract import parse
from gateway.errors import BadGateway, GatewayError
from gateway.failover import Attempt
from gateway.http_client import ConnectFailed, ProtocolFailed
from gateway.relay import Relay
from gateway.resolve import Prepared
from gateway.timing import RequestTimes
from gateway.upstream import Fault
from tests.gateway.stage_kit import (
    Client,
    FakePool,
    Scripted,
    chunk,
    config,
    gateway,
    reply,
    sse,
    tenant,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


async def relay_of(answers: list[Scripted], body: dict[str, Any] | None = None
                   ) -> tuple[Relay, Attempt, Client, FakePool]:
    gw = gateway(config(), {"http://m0": answers})
    who = tenant()
    body = body or CHAT
    req = parse("chat", body)
    target = await gw.resolver.target(req, who)
    p: Prepared = await gw.resolver.prepare("chat", req, body, target, who, "rid-7", None)
    member = gw.upstreams["m"].members[0]
    grant = member.breaker.try_pass()
    assert grant is not None
    client = Client()
    relay = Relay(p, reply(client), RequestTimes(0.0), [(b"x-sluice-queue-ms", b"0")],
                  gw.refresh)
    return relay, Attempt(member, grant, 1, p.worst_case), client, member.pool  # type: ignore[return-value]


def events(body: bytes) -> list[Any]:
    out = []
    for e in body.split(b"\n\n"):
        if e.startswith(b"data: ") and e != b"data: [DONE]":
            out.append(json.loads(e[6:]))
    return out


async def test_a_stream_is_rewritten_and_its_usage_settles_exactly() -> None:
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    stream = sse(chunk("Hel"), chunk("lo"), chunk(None, finish="stop"),
                 chunk(None, usage=usage), "[DONE]")
    # split mid-event: the relay must reassemble across reads
    relay, attempt, client, pool = await relay_of(
        [Scripted(chunks=[stream[:17], stream[17:60], stream[60:]])],
        {**CHAT, "stream": True})
    await relay.call(attempt)
    assert attempt.status == 200 and client.status == 200
    assert client.headers[b"x-sluice-queue-ms"] == b"0"
    sent = events(client.body)
    assert [e["choices"][0]["delta"].get("content") for e in sent if e["choices"]] == [
        "Hel", "lo", None]
    assert all(e["model"] == "m" and e["system_fingerprint"].startswith("fp_") for e in sent)
    assert client.body.endswith(b"data: [DONE]\n\n")
    result = relay.result()
    assert result.accepted and result.done and not result.upstream_failed
    assert result.tokens(relay.p) == (5, 2, True) and result.finish_reason == "stop"
    path, _, headers = pool.posts[0]
    assert path == "/v1/chat/completions" and (b"x-request-id", b"rid-7") in headers
    assert pool.responses[0].closed


async def test_a_stream_cut_short_is_a_502_and_settles_what_was_relayed() -> None:
    relay, attempt, _, _ = await relay_of(
        [Scripted(chunks=[sse(chunk("a"), chunk("b"))])], {**CHAT, "stream": True})
    with pytest.raises(BadGateway):
        await relay.call(attempt)
    result = relay.result()
    assert result.accepted and not result.done and result.chunks == 2
    assert result.tokens(relay.p)[1] == 2  # no usage arrived: the chunks relayed stand in


async def test_a_broken_connection_mid_answer_is_a_fault_after_the_bytes_sent() -> None:
    relay, attempt, _, _ = await relay_of(
        [Scripted(chunks=[sse(chunk("a"))], cut=ProtocolFailed("reset"))],
        {**CHAT, "stream": True})
    with pytest.raises(Fault) as caught:
        await relay.call(attempt)
    assert caught.value.reason == "disconnected"


async def test_an_unreachable_server_is_a_fault_before_anything_is_sent() -> None:
    relay, attempt, client, _ = await relay_of([Scripted(fail=ConnectFailed("refused"))])
    with pytest.raises(Fault) as caught:
        await relay.call(attempt)
    assert caught.value.reason == "connect" and client.messages == []
    assert not relay.result().accepted and relay.result().tokens(relay.p) == (0, 0, True)


async def test_a_5xx_is_a_fault_and_a_4xx_is_the_clients_error() -> None:
    relay, attempt, _, _ = await relay_of([Scripted(status=500, chunks=[b"{}"])])
    with pytest.raises(Fault) as fault:
        await relay.call(attempt)
    assert fault.value.reason == "http_500" and attempt.status == 500
    relay, attempt, _, _ = await relay_of([Scripted(status=400, chunks=[json.dumps(
        {"error": {"message": "bad", "code": "invalid_value", "param": "x"}}).encode()])])
    with pytest.raises(GatewayError) as refused:
        await relay.call(attempt)
    assert not isinstance(refused.value, Fault) and refused.value.status == 400
    assert refused.value.param == "x"


async def test_a_whole_answer_is_restamped_with_its_usage() -> None:
    answer = {"id": "x", "object": "chat.completion", "model": "fake-model",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "hey"},
                           "finish_reason": "length"}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}}
    relay, attempt, client, _ = await relay_of(
        [Scripted(chunks=[json.dumps(answer).encode()])])
    await relay.call(attempt)
    body = json.loads(client.body)
    assert body["model"] == "m" and body["system_fingerprint"].startswith("fp_")
    assert client.headers[b"content-length"] == str(len(client.body)).encode()
    assert b"x-sluice-resolved" in client.headers
    result = relay.result()
    assert result.done and result.tokens(relay.p) == (3, 8, True)
    assert result.finish_reason == "length"


async def test_an_error_event_inside_a_stream_marks_the_upstream_failed() -> None:
    relay, attempt, _, _ = await relay_of(
        [Scripted(chunks=[sse(chunk("a"), {"error": {"message": "boom"}}, "[DONE]")])],
        {**CHAT, "stream": True})
    await relay.call(attempt)
    assert relay.result().done and relay.result().upstream_failed


async def test_an_answer_is_stamped_with_the_versions_of_the_member_that_made_it() -> None:
    from protocol.versions import ResolvedVersions, ServedVersions

    other = ServedVersions("d" * 40, "t" * 64, None, "other-engine/2")
    whole = json.dumps({"id": "x", "object": "chat.completion", "model": "fake-model",
                        "choices": []}).encode()
    gw = gateway(config("http://a", "http://b"), {
        "http://b": [Scripted(chunks=[whole]), Scripted(chunks=[whole])]})
    members = gw.upstreams["m"].members
    members[1].versions = other  # mid-upgrade: b serves another revision than a
    who = tenant()

    async def call(body: dict[str, Any]) -> tuple[Relay, Client, Attempt]:
        req = parse("chat", body)
        target = await gw.resolver.target(req, who)
        p = await gw.resolver.prepare("chat", req, body, target, who, "rid", None)
        grant = members[1].breaker.try_pass()
        assert grant is not None
        client = Client()
        relay = Relay(p, reply(client), RequestTimes(0.0), [], gw.refresh)
        return relay, client, Attempt(members[1], grant, 1, p.worst_case)

    relay, client, attempt = await call(CHAT)
    assert relay.stamp.versions != other  # resolved with the pool's face (a's)
    await relay.call(attempt)
    expected = ResolvedVersions("m", other, who.policy_version)
    assert client.headers[b"x-sluice-resolved"] == expected.header_value().encode()
    assert json.loads(client.body)["system_fingerprint"] == expected.fingerprint()
    assert relay.result().stamp.versions is other
    # pinned to b's revision, but b moved back under it: refused before any byte, neutral
    relay, client, attempt = await call({**CHAT, "model": "m@" + "d" * 8})
    members[1].versions = ServedVersions("e" * 40, "t" * 64, None, "other-engine/3")
    with pytest.raises(Fault) as moved:
        await relay.call(attempt)
    assert moved.value.neutral and moved.value.err.code == "revision_mismatch"
    assert client.messages == []
