"""Cheap checks before expensive work, and no head-of-line blocking, at the gateway.

A near-limit body (3.8 MB of text) from a tenant capped at 8192 prompt tokens is refused
with 413 before anything tokenizes it: not the local tokenizer, not the upstream's
/v1/tokenize. Many small messages (the chat template's markup, not their text, makes the
prompt long) are refused after rendering, before encoding, in a worker; more than
``MAX_MESSAGES`` of them with a 400 before anything walks them. Long tokenizations share a
fair pool (429 past a tenant's share, while another tenant proceeds), and while one runs
the event loop keeps serving others.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from gateway.config import (
    Caps,
    GatewayConfig,
    Listen,
    ModelEntry,
    TenantEntry,
    TenantsFile,
    TokenizeConfig,
)
from gateway.contract import parse
from gateway.endpoint import LARGE_BODY_BYTES
from gateway.errors import BadRequest, PayloadTooLarge
from gateway.resolve import Prepared, Resolver
from gateway.service import Gateway, build_gateway
from gateway.tenants import Tenant, hash_key
from gateway.tokens import LocalCounter, OverLimit, UpstreamCounter
from modelfiles.tiny_model import CHAT_TEMPLATE
from modelfiles.tokenizer import Tokenizer
from protocol import http as protocol_http
from protocol.contract import MAX_MESSAGES
from protocol.errors import RateLimited, ServiceUnavailable
from protocol.prompt_bound import PromptBound

from .conftest import OTHER_KEY, TEST_KEY, ThreadedGateway, auth, config_for, tenants_for_tests
from .fake_backend import FakeBackend
from .stage_kit import VERSIONS

NEAR_LIMIT = "word " * 760_000  # 3.8 MB, under the 4 MiB body limit: ~950k tokens
CAP = 8192


def chat(text: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


def who(tenant_id: str, **caps: Any) -> Tenant:
    return Tenant.from_entry(TenantEntry(id=tenant_id, caps=Caps(**caps)))


# ---- a local tokenizer ------------------------------------------------------------------

@pytest.fixture
def local() -> Iterator[Gateway]:
    entry = ModelEntry(name="m", upstream="http://m0", kind="openai", tokenizer="local:tiny",
                       upstream_model="fake-model", versions=VERSIONS)
    cfg = GatewayConfig(listen=Listen(port=1), models=[entry], refresh_interval_s=3600,
                        tokenize=TokenizeConfig(workers=2, per_tenant=1))
    gw = build_gateway(cfg, tenants_for_tests())
    yield gw
    gw.tokenize_pool.close()


def counter_of(gw: Gateway) -> LocalCounter:
    counter = gw.upstreams["m"].counter
    assert isinstance(counter, LocalCounter)
    return counter


async def prepare(r: Resolver, body: dict[str, Any], tenant: Tenant) -> Prepared:
    req = parse("chat", body)
    target = await r.target(req, tenant)
    return await r.prepare("chat", req, body, target, tenant, "rid", None)


def count_calls(monkeypatch: pytest.MonkeyPatch, obj: object, *names: str) -> list[str]:
    calls: list[str] = []
    for name in names:
        original = getattr(obj, name)

        def wrapper(*args: Any, _name: str = name, _f: Any = original, **kw: Any) -> Any:
            calls.append(_name)
            return _f(*args, **kw)

        monkeypatch.setattr(obj, name, wrapper)
    return calls


async def test_a_near_limit_body_is_refused_without_tokenizing_it(
        local: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = counter_of(local).tokenizer
    calls = count_calls(monkeypatch, tok, "encode", "count", "encode_long",
                        "apply_chat_template")
    with pytest.raises(PayloadTooLarge) as refused:
        await prepare(local.resolver, chat(NEAR_LIMIT), who("a", max_prompt_tokens=CAP))
    assert refused.value.code == "prompt_too_long" and "at least" in refused.value.message
    assert calls == []
    # the same text under the cap is counted exactly, as before
    ok = await prepare(local.resolver, chat("word " * 100), who("a", max_prompt_tokens=CAP))
    assert ok.prompt_exact and 100 <= ok.prompt_tokens <= 250 and calls


async def test_a_prompt_over_the_context_is_refused_without_tokenizing_it(
        local: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    local.upstreams["m"].max_model_len = 4096
    calls = count_calls(monkeypatch, counter_of(local).tokenizer, "encode", "count",
                        "apply_chat_template")
    with pytest.raises(BadRequest) as refused:
        await prepare(local.resolver, chat(NEAR_LIMIT), who("a"))
    assert refused.value.code == "context_length_exceeded" and calls == []


# 1500 empty messages: no text at all, but the template's markup (28 bytes each, plus the
# bos and the generation prompt: 42,039 bytes) proves at least 2473 tokens to a tokenizer
# whose longest token is 17 bytes; they encode to about 7500.
MANY = [{"role": "user", "content": ""}] * 1500
SMALL_CAP = 1000


def threads_of(monkeypatch: pytest.MonkeyPatch, obj: object, name: str) -> list[str]:
    """The names of the threads ``obj.name`` is called in."""
    threads: list[str] = []
    original = getattr(obj, name)

    def wrapper(*args: Any, **kw: Any) -> Any:
        threads.append(threading.current_thread().name)
        return original(*args, **kw)

    monkeypatch.setattr(obj, name, wrapper)
    return threads


async def test_many_small_messages_are_refused_in_a_worker_before_encoding(
        local: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = counter_of(local).tokenizer
    rendered = threads_of(monkeypatch, tok, "apply_chat_template")
    calls = count_calls(monkeypatch, tok, "encode", "count", "encode_long")
    with pytest.raises(PayloadTooLarge) as refused:
        await prepare(local.resolver, {"model": "m", "messages": MANY},
                      who("a", max_prompt_tokens=SMALL_CAP))
    err = refused.value
    assert err.code == "prompt_too_long" and err.param == "messages"
    assert "at least 2473 tokens" in err.message, err.message
    assert calls == []  # rendered and bounded; never encoded
    assert len(rendered) == 1 and rendered[0].startswith("sluice-tokenize")  # not the loop
    # under a cap it fits, the same messages are counted exactly
    ok = await prepare(local.resolver, {"model": "m", "messages": MANY},
                       who("a", max_prompt_tokens=10_000))
    assert ok.prompt_tokens > 1500 * 4 and calls == ["count"]


TOOLS_TEMPLATE = CHAT_TEMPLATE + "{%- for tool in tools or [] %}{{- tool | tojson }}{%- endfor %}"


async def test_tools_the_template_renders_count_in_the_bound(
        local: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    counter = counter_of(local)
    tiny = counter.tokenizer
    counter.tokenizer = Tokenizer(tiny.backend, sha256=tiny.sha256,
                                  special_tokens=tiny.special_tokens_map,
                                  chat_template=TOOLS_TEMPLATE)
    calls = count_calls(monkeypatch, counter.tokenizer, "encode", "count", "encode_long")
    tools = [{"type": "function", "function": {"name": f"f{i}", "description": "d" * 400}}
             for i in range(50)]  # ~22 KB of JSON in the rendered prompt: over 1000 tokens
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    with pytest.raises(PayloadTooLarge) as refused:
        await prepare(local.resolver, body, who("a", max_prompt_tokens=SMALL_CAP))
    assert "at least" in refused.value.message and calls == []


async def test_a_render_over_its_json_value_budget_is_a_400_before_rendering(
        local: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    # one message, under the message cap, with 70,000 numbers in an extra key: the template
    # ignores them, but copying them cost the worker as much as rendering 70,000 messages
    calls = count_calls(monkeypatch, counter_of(local).tokenizer, "apply_chat_template",
                        "count")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi", "x": [0] * 70_000}]}
    with pytest.raises(BadRequest) as refused:
        await prepare(local.resolver, body, who("a"))
    assert refused.value.param == "messages" and "JSON values" in refused.value.message
    assert calls == []


@pytest.fixture
def many_gateway() -> Iterator[ThreadedGateway]:
    """A gateway with a local tokenizer in front of a fake OpenAI upstream: tenant "one"
    capped at ``SMALL_CAP`` prompt tokens, tenant "two" not."""
    tenants = TenantsFile(tenants=[
        TenantEntry(id="one", keys=[hash_key(TEST_KEY)], caps=Caps(max_prompt_tokens=SMALL_CAP)),
        TenantEntry(id="two", keys=[hash_key(OTHER_KEY)])])
    with FakeBackend() as fake:
        cfg = config_for(fake.url, kind="openai", tokenizer="local:tiny", versions=VERSIONS)
        with ThreadedGateway(cfg, tenants) as g:
            yield g


def chat_many(n: int) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": ""}] * n}


def test_more_than_max_messages_is_a_400_before_anything_is_rendered(
        many_gateway: ThreadedGateway, monkeypatch: pytest.MonkeyPatch) -> None:
    g = many_gateway
    counter = g.gateway.upstreams["m"].counter
    assert isinstance(counter, LocalCounter)
    calls = count_calls(monkeypatch, counter.tokenizer, "apply_chat_template", "encode",
                        "count", "encode_long")
    # the review's attack: 120,000 empty messages, 3.96 MB, under the 4 MiB body limit
    r = httpx.post(g.url + "/v1/chat/completions", json=chat_many(120_000),
                   headers=auth(TEST_KEY), timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and f"at most {MAX_MESSAGES}" in err["message"]
    assert calls == []
    at_cap = httpx.post(g.url + "/v1/chat/completions", json=chat_many(MAX_MESSAGES),
                        headers=auth(OTHER_KEY), timeout=60)
    # the cap itself passes the contract: counted (12,294 tokens), over the fake's context
    assert at_cap.json()["error"]["code"] == "context_length_exceeded", at_cap.text
    assert calls == ["apply_chat_template", "count"]


def test_the_loop_serves_others_while_many_messages_are_rendered(
        many_gateway: ThreadedGateway, monkeypatch: pytest.MonkeyPatch) -> None:
    g = many_gateway
    counter = g.gateway.upstreams["m"].counter
    assert isinstance(counter, LocalCounter)
    tok = counter.tokenizer
    entered, release = threading.Event(), threading.Event()
    render = tok.apply_chat_template

    def held(messages: Any, *args: Any, **kw: Any) -> str:
        if len(messages) >= len(MANY):  # the attacker's: held in its worker thread
            entered.set()
            release.wait(30)  # bounded: a render on the loop fails the test, not hangs it
        return render(messages, *args, **kw)

    monkeypatch.setattr(tok, "apply_chat_template", held)
    encoded = count_calls(monkeypatch, tok, "encode", "count", "encode_long")
    attack: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: attack.append(httpx.post(
        g.url + "/v1/chat/completions", json=chat_many(len(MANY)),
        headers=auth(TEST_KEY), timeout=60)))
    thread.start()
    try:
        assert entered.wait(30)
        small = httpx.post(g.url + "/v1/chat/completions", json=chat("hi"),
                           headers=auth(OTHER_KEY), timeout=30)
        # answered while the attacker's prompt was still being rendered, off the loop
        assert small.status_code == 200 and not attack and encoded == ["count"]
    finally:
        release.set()
        thread.join(60)
    assert attack[0].status_code == 413, attack[0].text
    assert "at least" in attack[0].json()["error"]["message"]
    assert encoded == ["count"]  # the victim's prompt only: the attacker's never encoded


class Blocking:
    """Wraps ``Tokenizer.count``: the first long text waits for ``release``."""

    def __init__(self, count: Callable[..., int]) -> None:
        self.count = count
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, text: str, *args: Any, **kw: Any) -> int:
        if len(text) > 10_000 and not self.started.is_set():
            self.started.set()
            self.release.wait(10)  # bounded: code that runs this on the loop fails, not hangs
        return self.count(text, *args, **kw)


async def test_a_tenant_over_its_tokenizing_share_gets_429_while_another_proceeds(
        local: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = counter_of(local).tokenizer
    blocking = Blocking(tok.count)
    monkeypatch.setattr(tok, "count", blocking)
    long_text = "word " * 5_000  # 25 KB: a long prompt, allowed
    first = asyncio.create_task(prepare(local.resolver, chat(long_text), who("a")))
    await asyncio.get_running_loop().run_in_executor(None, blocking.started.wait, 10)
    with pytest.raises(RateLimited) as refused:
        await prepare(local.resolver, chat(long_text + "again"), who("a"))
    err = refused.value
    assert err.status == 429 and err.code == "tokenize_concurrency"
    assert {b"retry-after", b"retry-after-ms"} <= dict(err.headers()).keys()
    assert err.body()["error"]["type"] == "rate_limit_error"
    other = await prepare(local.resolver, chat(long_text), who("b"))  # b is not held up
    assert other.prompt_tokens > 5_000 and not first.done()
    metrics = local.metrics.render()
    assert 'sluice_gateway_tokenize_refused_total{reason="tokenize_concurrency"} 1.0' in metrics
    assert 'sluice_gateway_tokenize_refused_total{reason="tokenizer_busy"} 0.0' in metrics
    assert "sluice_gateway_tokenize_running 1.0" in metrics  # a's, held
    assert "sluice_gateway_memory_trims_total 0.0" in metrics
    blocking.release.set()
    assert (await first).prompt_tokens == other.prompt_tokens


class Watched:
    """Stands in for the ``tokenizers.Tokenizer`` inside a ``Tokenizer``: ``entered`` is
    set as a long text goes in, ``returned`` once its tokens come out."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.entered = threading.Event()
        self.returned = False

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._backend, name)
        if name not in ("encode", "encode_batch", "encode_batch_fast"):
            return method

        def watched(first: Any, *args: Any, **kw: Any) -> Any:
            text = first if isinstance(first, str) else "".join(first)
            if len(text) < 100_000:
                return method(first, *args, **kw)
            self.entered.set()
            try:
                return method(first, *args, **kw)
            finally:
                self.returned = True

        return watched


async def test_a_long_tokenization_does_not_block_the_event_loop(local: Gateway) -> None:
    counter = counter_of(local)
    watched = Watched(counter.tokenizer.backend)
    counter.tokenizer._backend = watched  # type: ignore[assignment]  # a spy, duck-typed
    # allowed (no cap), and long: ~0.5 s of tokenizing
    big = asyncio.create_task(counter.count("completion", "word " * 400_000, tenant="a"))
    await asyncio.get_running_loop().run_in_executor(None, watched.entered.wait, 30)
    for _ in range(2000):  # the loop turns many times: not just in a moment the GIL is free
        await asyncio.sleep(0)
    small = await counter.count("completion", "hello there", tenant="b")
    # the small one was counted while the big one was inside the tokenizer, which lets the
    # loop run (plain tokenizers.encode holds the GIL for all but its last few ms)
    assert small > 0 and not watched.returned and not big.done()
    assert await big >= 400_000


# ---- the upstream's tokenizer (the bundled backend's /v1/tokenize) ----------------------

@pytest.fixture(scope="module")
def fake() -> Iterator[FakeBackend]:
    with FakeBackend() as f:
        f.token_bound = PromptBound(17).report()  # what the tiny tokenizer reports
        yield f


def test_the_upstreams_bound_refuses_before_posting_to_tokenize(fake: FakeBackend) -> None:
    with ThreadedGateway(config_for(fake.url),
                         tenants_for_tests(max_prompt_tokens=CAP)) as g:
        assert g.gateway.upstreams["m"].token_bound == PromptBound(17)
        fake.tokenized.clear()
        r = httpx.post(g.url + "/v1/chat/completions", json=chat(NEAR_LIMIT), headers=auth(),
                       timeout=30)
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "prompt_too_long"
        assert fake.tokenized == []  # nothing was sent to be counted
        ok = httpx.post(g.url + "/v1/chat/completions", json=chat("hello"), headers=auth(),
                        timeout=30)
        assert ok.status_code == 200
        assert [h.get("x-sluice-tenant") for h in fake.tokenized] == ["one"]


def test_a_large_body_is_parsed_in_the_worker_process_never_on_the_loop(
        fake: FakeBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    # 120k empty messages (3.9 MB): ~40 ms of parsing and ~7 ms of freeing that would
    # hold the gateway's loop; the worker refuses them and sends back only the error
    parsed_here: list[int] = []
    loads = protocol_http.loads_strict
    monkeypatch.setattr(protocol_http, "loads_strict",
                        lambda raw, *a: parsed_here.append(len(raw)) or loads(raw, *a))
    many = json.dumps({"model": "m", "messages": [{"role": "user", "content": ""}] * 120_000})
    assert len(many) > LARGE_BODY_BYTES
    with ThreadedGateway(config_for(fake.url), tenants_for_tests()) as g:
        r = httpx.post(g.url + "/v1/chat/completions", content=many, headers=auth(),
                       timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages"
        # valid and large (JSON whitespace is free): parsed there, served here
        big = json.dumps(chat("hello")) + " " * LARGE_BODY_BYTES
        ok = httpx.post(g.url + "/v1/chat/completions", content=big, headers=auth(),
                        timeout=60)
        assert ok.status_code == 200, ok.text
        small = httpx.post(g.url + "/v1/chat/completions", json=chat("hi"), headers=auth())
        assert small.status_code == 200
        snap = g.gateway.parse_pool.snapshot()
        assert (snap.running, snap.waiting, snap.tenants) == (0, 0, 0)
        metrics = httpx.get(g.url + "/metrics").text
        assert "sluice_gateway_parse_running 0.0" in metrics
        assert 'sluice_gateway_parse_refused_total{reason="large_bodies_busy"} 0.0' in metrics
    assert parsed_here and max(parsed_here) < LARGE_BODY_BYTES  # only the small one here


def test_only_a_sluice_upstream_is_told_the_tenant(fake: FakeBackend) -> None:
    # vLLM (kind: openai) has /v1/tokenize too, but no business knowing our tenants
    cfg = config_for(fake.url, kind="openai", tokenizer="upstream", versions=VERSIONS)
    with ThreadedGateway(cfg, tenants_for_tests()) as g:
        fake.tokenized.clear()
        ok = httpx.post(g.url + "/v1/chat/completions", json=chat("hello"), headers=auth(),
                        timeout=30)
        assert ok.status_code == 200, ok.text
        assert len(fake.tokenized) == 1 and "x-sluice-tenant" not in fake.tokenized[0]


def test_the_context_bound_refuses_before_posting_to_tokenize(fake: FakeBackend) -> None:
    with ThreadedGateway(config_for(fake.url), tenants_for_tests()) as g:
        fake.tokenized.clear()
        r = httpx.post(g.url + "/v1/chat/completions", json=chat(NEAR_LIMIT), headers=auth(),
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert fake.tokenized == []


@pytest.mark.parametrize(("status", "error"), [(429, RateLimited), (503, ServiceUnavailable)])
async def test_a_busy_upstream_tokenizer_is_answered_with_its_retry_after(
        status: int, error: type[Exception]) -> None:
    def busy(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, headers={"retry-after": "3", "retry-after-ms": "2500"},
                              json={"error": {"message": "busy", "type": "x", "code": "y"}})

    async with httpx.AsyncClient(transport=httpx.MockTransport(busy),
                                 base_url="http://up") as client:
        counter = UpstreamCounter(client, "m", lambda: "v", bound=lambda: PromptBound(4))
        with pytest.raises(error) as refused:
            await counter.count("completion", "hello", tenant="a", limit=100)
        assert getattr(refused.value, "retry_after_s", None) == 2.5
        with pytest.raises(OverLimit) as over:
            await counter.count("completion", "x" * 404, tenant="a", limit=100)
        assert over.value.at_least == 101


async def test_the_upstream_counter_refuses_past_the_render_budget_before_posting() -> None:
    posted: list[httpx.Request] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        posted.append(request)
        return httpx.Response(200, json={"count": 3})

    async with httpx.AsyncClient(transport=httpx.MockTransport(upstream),
                                 base_url="http://up") as client:
        counter = UpstreamCounter(client, "m", lambda: "v")
        parts = [{"type": "text", "text": ""}] * 70_000  # one message: under the message cap
        with pytest.raises(BadRequest) as refused:
            await counter.count("chat", [{"role": "user", "content": parts}], tenant="a")
        assert refused.value.param == "messages" and posted == []  # nothing serialized, sent
        assert await counter.count("chat", [{"role": "user", "content": "hi"}]) == 3
        assert posted[0].headers["content-type"] == "application/json"
        assert "x-sluice-tenant" not in posted[0].headers  # not known to be a sluice server
