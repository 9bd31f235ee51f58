"""The gateway in front of a scriptable upstream: what it forwards, how it relays and stamps,
how it maps upstream failures, and how it follows version changes."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .conftest import ThreadedGateway, auth, config_for, tenants_for_tests
from .fake_backend import FakeBackend

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


@pytest.fixture
def fake() -> Iterator[FakeBackend]:
    with FakeBackend() as f:
        yield f


@pytest.fixture
def gw(fake: FakeBackend) -> Iterator[ThreadedGateway]:
    with ThreadedGateway(config_for(fake.url), tenants_for_tests(max_tokens=100,
                                                                  on_exceed="clamp")) as g:
        yield g


def post(gw: ThreadedGateway, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", json=body,
                      headers={**auth(), **headers}, timeout=30)


def stream_events(resp: httpx.Response) -> list[Any]:
    out: list[Any] = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_the_upstream_gets_the_resolved_body(gw: ThreadedGateway, fake: FakeBackend) -> None:
    resp = post(gw, {**CHAT, "stream": True, "deadline_ms": 60000, "temperature": 0.5})
    assert resp.status_code == 200
    sent = fake.bodies[-1]
    assert sent["model"] == "fake-model"  # the upstream's name for the public model "m"
    assert sent["priority"] == 4  # the tenant's default
    assert len(sent["cache_salt"]) == 32  # derived per tenant
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert sent["max_tokens"] == 100  # the cap, since the client set none
    assert sent["temperature"] == 0.5
    assert "deadline_ms" not in sent
    assert resp.headers["x-sluice-clamped"] == "max_tokens=100; requested=unset"


def test_cache_salt_differs_per_tenant_and_clients_cannot_set_it(
        gw: ThreadedGateway, fake: FakeBackend) -> None:
    resp = post(gw, {**CHAT, "cache_salt": "mine"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt"
    assert not fake.bodies


def test_stream_is_rewritten_for_the_client(gw: ThreadedGateway, fake: FakeBackend) -> None:
    with httpx.stream("POST", gw.url + "/v1/chat/completions", headers=auth(),
                      json={**CHAT, "stream": True}, timeout=30) as resp:
        events = stream_events(resp)
        stamp = resp.headers["x-sluice-resolved"]
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == fake.chunks  # the usage chunk is dropped: not asked for
    assert all("usage" not in c for c in chunks)
    assert {c["model"] for c in chunks} == {"m"}
    assert len({c["system_fingerprint"] for c in chunks}) == 1
    assert chunks[0]["system_fingerprint"] != "fp_up"
    assert stamp.startswith("model=m; revision=aaaaaaaaaaaa; tokenizer=bbbbbbbbbbbb; "
                            "chat_template=cccccccccccc; engine=fake-engine/1; policy=one@")


def test_usage_is_passed_on_as_the_client_asked(gw: ThreadedGateway) -> None:
    with httpx.stream("POST", gw.url + "/v1/chat/completions", headers=auth(), timeout=30,
                      json={**CHAT, "stream": True,
                            "stream_options": {"include_usage": True}}) as resp:
        chunks = stream_events(resp)[:-1]
    assert all(c["usage"] is None for c in chunks[:-1])  # OpenAI's shape: null until the end
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    with httpx.stream("POST", gw.url + "/v1/chat/completions", headers=auth(), timeout=30,
                      json={**CHAT, "stream": True, "stream_options": {
                          "include_usage": True, "continuous_usage_stats": True}}) as resp:
        chunks = stream_events(resp)[:-1]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4, 5, 5]


def test_whole_answers_are_stamped(gw: ThreadedGateway) -> None:
    resp = post(gw, CHAT)
    body = resp.json()
    assert body["model"] == "m" and body["system_fingerprint"].startswith("fp_")
    assert body["usage"]["completion_tokens"] == 5
    assert resp.headers["x-sluice-resolved"].startswith("model=m; revision=aaaaaaaaaaaa")
    comp = httpx.post(gw.url + "/v1/completions", headers=auth(), timeout=30,
                      json={"model": "m", "prompt": "a b c"})
    assert comp.json()["choices"][0]["text"] == " w0 w1 w2 w3 w4"


@pytest.mark.parametrize(("mode", "status", "retry"), [("500", 502, None), ("503", 503, "7"),
                                                       ("400", 400, None)])
def test_upstream_errors_map_to_clean_client_errors(gw: ThreadedGateway, fake: FakeBackend,
                                                   mode: str, status: int,
                                                   retry: str | None) -> None:
    fake.mode = mode
    resp = post(gw, {**CHAT, "stream": True})
    assert resp.status_code == status
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "code", "param"}
    if status >= 500:
        assert "Traceback" not in resp.text  # never the upstream's internals
        assert resp.headers["x-sluice-resolved"].startswith("model=m;")
    else:
        assert err["message"].startswith("boom")  # a refusal is the upstream's to explain
    assert resp.headers.get("retry-after") == retry


def test_an_upstream_dying_mid_stream_ends_with_an_error_event(gw: ThreadedGateway,
                                                               fake: FakeBackend) -> None:
    fake.mode = "die"
    with httpx.stream("POST", gw.url + "/v1/chat/completions", headers=auth(), timeout=30,
                      json={**CHAT, "stream": True}) as resp:
        assert resp.status_code == 200
        events = stream_events(resp)
    assert len(events) == 4 and events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "upstream_error"
    assert events[-2]["error"]["status"] == 502


def test_an_unreachable_upstream_is_503_with_retry_after(fake: FakeBackend) -> None:
    with ThreadedGateway(config_for(fake.url), tenants_for_tests()) as g:
        fake.__exit__()  # the upstream goes away after the gateway resolved it
        resp = post(g, CHAT)
    assert resp.status_code == 503
    assert resp.headers["retry-after"] == "1" and resp.headers["retry-after-ms"] == "1000"


def test_a_deadline_passing_before_the_first_byte_is_504(gw: ThreadedGateway,
                                                       fake: FakeBackend) -> None:
    fake.mode = "stall"
    start = time.monotonic()
    resp = post(gw, {**CHAT, "stream": True}, **{"x-sluice-deadline-ms": "300"})
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "deadline_exceeded"
    assert time.monotonic() - start < 5
    fake.release.set()
    bad = post(gw, CHAT, **{"x-sluice-deadline-ms": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-sluice-deadline-ms"


def test_a_disconnect_closes_the_upstream_stream(gw: ThreadedGateway,
                                                 fake: FakeBackend) -> None:
    fake.mode = "hold"
    with httpx.stream("POST", gw.url + "/v1/chat/completions", headers=auth(), timeout=30,
                      json={**CHAT, "stream": True}) as resp:
        seen = 0
        for line in resp.iter_lines():
            seen += line.startswith("data: {")
            if seen == 2:
                break
    deadline = time.monotonic() + 5
    while fake.aborted == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake.aborted == 1 and fake.finished == 0
    ledger = gw.gateway.ledger
    assert ledger.by_key[("one", "m", "cancelled")] == 1
    # running usage (continuous_usage_stats) settles the two tokens relayed
    assert ledger.by_tenant["one"].completion_tokens == 2


def test_versions_change_for_new_requests_never_in_flight(gw: ThreadedGateway,
                                                          fake: FakeBackend) -> None:
    fake.mode = "hold"
    results: dict[str, Any] = {}

    def in_flight() -> None:
        with httpx.stream("POST", gw.url + "/v1/chat/completions", headers=auth(), timeout=30,
                          json={**CHAT, "stream": True}) as resp:
            results["stamp"] = resp.headers["x-sluice-resolved"]
            results["events"] = stream_events(resp)

    t = threading.Thread(target=in_flight)
    t.start()
    while len(fake.bodies) < 1:
        time.sleep(0.01)
    time.sleep(0.2)
    old_fp = None
    fake.revision = "d" * 64  # the upstream is upgraded while the first request streams
    fake.mode = "ok"
    # No refresh yet: the next answer's header tells the gateway, which re-reads at once.
    resp = post(gw, CHAT)
    assert "revision=dddddddddddd" in resp.headers["x-sluice-resolved"]
    new_fp = resp.json()["system_fingerprint"]
    fake.release.set()
    t.join(10)
    assert "revision=aaaaaaaaaaaa" in results["stamp"]
    fps = {e["system_fingerprint"] for e in results["events"] if isinstance(e, dict)}
    assert len(fps) == 1
    old_fp = fps.pop()
    assert old_fp != new_fp
    # pins follow the new revision
    assert post(gw, {**CHAT, "model": "m@dddddddd"}).status_code == 200
    stale = post(gw, {**CHAT, "model": "m@aaaaaaaa"})  # no server serves it any more
    assert stale.status_code == 503 and stale.json()["error"]["code"] == "revision_unavailable"
    assert stale.headers["retry-after"] == "3600"  # the refresh interval


def test_a_pin_shorter_than_7_hex_characters_is_refused_as_too_short(
        gw: ThreadedGateway) -> None:
    assert post(gw, {**CHAT, "model": "m@aaaaaaa"}).status_code == 200
    short = post(gw, {**CHAT, "model": "m@aaaaaa"})  # a prefix of the revision, but 6
    err = short.json()["error"]
    assert short.status_code == 400 and err["code"] == "revision_mismatch"
    assert err["message"].endswith("a pin needs at least 7 hex characters of the revision "
                                   "(or all of it), and 'aaaaaa' has 6")


def test_models_lists_only_the_tenants_models(gw: ThreadedGateway) -> None:
    from .conftest import OTHER_KEY

    mine = httpx.get(gw.url + "/v1/models", headers=auth()).json()["data"]
    assert [m["id"] for m in mine] == ["m"] and mine[0]["revision"] == "a" * 64
    theirs = httpx.get(gw.url + "/v1/models", headers=auth(OTHER_KEY)).json()["data"]
    assert theirs == []
    denied = httpx.post(gw.url + "/v1/chat/completions", headers=auth(OTHER_KEY), json=CHAT)
    assert denied.status_code == 404


def test_readyz_reports_an_unreachable_upstream(fake: FakeBackend) -> None:
    with ThreadedGateway(config_for(fake.url), tenants_for_tests()) as g:
        assert httpx.get(g.url + "/readyz").status_code == 200
        fake.__exit__()
        time.sleep(1.1)  # readiness is probed at most once a second
        resp = httpx.get(g.url + "/readyz")
        assert resp.status_code == 503
        assert resp.json()["checks"]["m"]["ok"] is False
        assert httpx.get(g.url + "/healthz").status_code == 200


def test_byte_counted_prompts_are_bounded_and_capped(fake: FakeBackend) -> None:
    cfg = config_for(fake.url, kind="openai", tokenizer="bytes",
                     versions={"revision": "r1", "tokenizer": "t1", "engine": "vllm"})
    with ThreadedGateway(cfg, tenants_for_tests(max_prompt_tokens=80)) as g:
        ok = post(g, CHAT)
        assert ok.status_code == 200
        assert ok.headers["x-sluice-resolved"].startswith(
            "model=m; revision=r1; tokenizer=t1; chat_template=none; engine=vllm;")
        big = post(g, {**CHAT, "messages": [{"role": "user", "content": "x" * 100}]})
        assert big.status_code == 413
        assert "upper bound" in big.json()["error"]["message"]
        sent = fake.bodies[-1]
        assert "priority" not in sent and "cache_salt" not in sent  # not an openai feature
        assert sent["stream_options"] if sent.get("stream") else True
