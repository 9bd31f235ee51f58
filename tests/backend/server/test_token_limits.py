"""Cheap checks before expensive work, and no head-of-line blocking, at the backend.

The app runs in-process (uvicorn in a thread, the tiny model) so that the tests can watch
its tokenizer: a prompt whose text alone exceeds the context is refused before it is
tokenized; long tokenizations share a pool fair across the tenants the gateway names
(``x-sluice-tenant``); and while one runs, the event loop answers others.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any, Self

import httpx
import pytest
import uvicorn

from backend.engine.config import EngineConfig
from backend.server.app import ServerSettings, create_app
from backend.server.service import ModelService
from protocol.contract import MAX_MESSAGES
from protocol.offload import OffloadSettings
from tests.gateway.test_token_limits import MANY, NEAR_LIMIT, Watched, count_calls, threads_of

from .conftest import free_port


class ThreadedBackend:
    """The backend app on a real 127.0.0.1 socket, served by uvicorn in a thread."""

    def __init__(self, settings: ServerSettings) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(EngineConfig(model="tiny", device="cpu"), settings)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", lifespan="on"))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.server.serve())

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the threaded backend did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    @property
    def service(self) -> ModelService:
        service: ModelService = self.app.state.service
        return service


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Any) -> Iterator[ThreadedBackend]:
    settings = ServerSettings(tokenize=OffloadSettings(workers=2, per_tenant=1, max_waiting=4))
    with ThreadedBackend(settings) as b:
        yield b


def test_models_reports_the_tokenizers_bound(backend: ThreadedBackend) -> None:
    entry = httpx.get(backend.url + "/v1/models", timeout=10).json()["data"][0]
    assert entry["token_bound"] == {"max_token_bytes": 17, "ascii_only": False}


def test_a_prompt_over_the_context_is_refused_without_tokenizing_it(
        backend: ThreadedBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_calls(monkeypatch, backend.service.tokenizer, "encode", "encode_long",
                        "count", "apply_chat_template")
    for path, body in (("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": NEAR_LIMIT}]}),
                       ("/v1/completions", {"prompt": NEAR_LIMIT})):
        r = httpx.post(backend.url + path, json={**body, "max_tokens": 1}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and "at least" in err["message"]
    assert calls == []
    ok = httpx.post(backend.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 1},
                    timeout=30)
    assert ok.status_code == 200 and calls


def test_more_than_max_messages_is_a_400_before_anything_is_rendered(
        backend: ThreadedBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_calls(monkeypatch, backend.service.tokenizer, "apply_chat_template",
                        "encode", "encode_long")
    many = [{"role": "user", "content": ""}] * 120_000  # 3.96 MB, under the body limit
    for path, body in (("/v1/chat/completions", {"messages": many, "max_tokens": 1}),
                       ("/v1/tokenize", {"messages": many})):
        r = httpx.post(backend.url + path, json=body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages" and err["code"] == "invalid_value"
        assert f"at most {MAX_MESSAGES}" in err["message"]
    assert calls == []


def test_many_small_messages_are_refused_in_a_worker_before_encoding(
        backend: ThreadedBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = backend.service.tokenizer
    rendered = threads_of(monkeypatch, tok, "apply_chat_template")
    calls = count_calls(monkeypatch, tok, "encode", "encode_long")
    # no text, but their markup proves at least 2473 tokens: over the context of 2048
    r = httpx.post(backend.url + "/v1/chat/completions",
                   json={"messages": MANY, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "at least 2473" in err["message"]
    assert calls == [] and len(rendered) == 1 and rendered[0].startswith("sluice-tokenize")
    # /v1/tokenize counts prompts of any length: the same messages are encoded there
    counted = httpx.post(backend.url + "/v1/tokenize", json={"messages": MANY}, timeout=60)
    assert counted.status_code == 200 and counted.json()["count"] > 2048 and calls


def test_the_loop_serves_others_while_many_messages_are_rendered(
        backend: ThreadedBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = backend.service.tokenizer
    entered, release = threading.Event(), threading.Event()
    render = tok.apply_chat_template

    def held(messages: Any, *args: Any, **kw: Any) -> str:
        if len(messages) >= len(MANY):  # the attacker's: held in its worker thread
            entered.set()
            release.wait(30)  # bounded: a render on the loop fails the test, not hangs it
        return render(messages, *args, **kw)

    monkeypatch.setattr(tok, "apply_chat_template", held)
    encoded = count_calls(monkeypatch, tok, "encode", "encode_long")
    attack: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: attack.append(httpx.post(
        backend.url + "/v1/chat/completions", json={"messages": MANY, "max_tokens": 1},
        headers={"x-sluice-tenant": "a"}, timeout=60)))
    thread.start()
    try:
        assert entered.wait(30)
        small = httpx.post(backend.url + "/v1/tokenize", json={"prompt": "hello"},
                           headers={"x-sluice-tenant": "b"}, timeout=30)
        # answered while the attacker's prompt was still being rendered, off the loop
        assert small.status_code == 200 and not attack and encoded == ["encode"]
    finally:
        release.set()
        thread.join(60)
    assert attack[0].status_code == 400 and "at least" in attack[0].json()["error"]["message"]
    assert encoded == ["encode"]  # the small prompt only: the attacker's never encoded


class Blocking:
    """Stands in for the ``tokenizers.Tokenizer``: the first long text waits for
    ``release``."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.started = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._backend, name)
        if name not in ("encode", "encode_batch", "encode_batch_fast"):
            return method

        def blocking(first: Any, *args: Any, **kw: Any) -> Any:
            text = first if isinstance(first, str) else "".join(first)
            if len(text) > 10_000 and not self.started.is_set():
                self.started.set()
                self.release.wait(10)  # bounded: code that blocks the loop fails, not hangs
            return method(first, *args, **kw)

        return blocking


def test_a_tenant_over_its_tokenizing_share_gets_429_while_others_proceed(
        backend: ThreadedBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = backend.service.tokenizer
    blocking = Blocking(tok.backend)
    monkeypatch.setattr(tok, "_backend", blocking)
    body = {"prompt": "word " * 5_000}  # 25 KB: a long prompt, within the context

    def tokenize(tenant: str | None) -> httpx.Response:
        headers = {} if tenant is None else {"x-sluice-tenant": tenant}
        return httpx.post(backend.url + "/v1/tokenize", json=body, headers=headers, timeout=30)

    first: list[httpx.Response] = []
    held = threading.Thread(target=lambda: first.append(tokenize("a")))
    held.start()
    try:
        assert blocking.started.wait(10)
        refused = tokenize("a")
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "tokenize_concurrency"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert int(refused.headers["retry-after"]) >= 1 and refused.headers["retry-after-ms"]
        other = tokenize("b")  # while a's is still held
        anonymous = tokenize(None)
        assert not first
        metrics = httpx.get(backend.url + "/metrics", timeout=10).text
        assert 'sluice_backend_tokenize_refused_total{reason="tokenize_concurrency"} 1.0' \
            in metrics
        assert 'sluice_backend_tokenize_refused_total{reason="tokenizer_busy"} 0.0' in metrics
        assert "sluice_backend_tokenize_running 1.0" in metrics  # a's, held
        assert "sluice_backend_memory_trims_total" in metrics
    finally:
        blocking.release.set()
        held.join(30)
    assert other.status_code == anonymous.status_code == first[0].status_code == 200
    assert other.json()["count"] == first[0].json()["count"] > 5_000


def test_a_long_tokenization_does_not_block_the_event_loop(backend: ThreadedBackend,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    tok = backend.service.tokenizer
    watched = Watched(tok.backend)
    monkeypatch.setattr(tok, "_backend", watched)
    big: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: big.append(httpx.post(
        backend.url + "/v1/tokenize", json={"prompt": "word " * 400_000},
        headers={"x-sluice-tenant": "a"}, timeout=60)))
    thread.start()
    try:
        assert watched.entered.wait(30)
        small = httpx.post(backend.url + "/v1/tokenize", json={"prompt": "hello"},
                           headers={"x-sluice-tenant": "b"}, timeout=60)
        # answered while the big one was still inside the tokenizer
        assert small.status_code == 200 and not watched.returned and not big
    finally:
        thread.join(60)
    assert big[0].status_code == 200 and big[0].json()["count"] >= 400_000
