"""The backend's API key: every route but /health needs it (a real `sluice backend` started
with $SLUICE_BACKEND_API_KEY), the middleware alone, and how `sluice backend` picks its key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backend.server.auth import API_KEY_ENV, ApiKeyMiddleware, resolve_api_key

from .conftest import BACKEND_KEY, Backend, start_backend

COMPLETION = {"prompt": "hello", "max_tokens": 2, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
GUARDED = [("POST", "/v1/chat/completions", CHAT), ("POST", "/v1/completions", COMPLETION),
           ("GET", "/v1/models", None), ("POST", "/v1/tokenize", {"prompt": "hello"}),
           ("GET", "/v1/state", None), ("GET", "/metrics", None)]
REFUSED = [None, "Bearer sk-wrong", f"Basic {BACKEND_KEY}", "Bearer", f"Bearer {BACKEND_KEY}x",
           f"bearer {BACKEND_KEY[:-1]}"]


@pytest.fixture(scope="module")
def keyed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    b = start_backend(tmp_path_factory.mktemp("keyed"), api_key=BACKEND_KEY)
    yield b
    b.stop()


def call(b: Backend, method: str, path: str, body: Any,
         authorization: str | None) -> httpx.Response:
    headers = {} if authorization is None else {"authorization": authorization}
    return httpx.request(method, b.url + path, json=body, headers=headers, timeout=30)


@pytest.mark.parametrize(("method", "path", "body"), GUARDED, ids=[p for _, p, _ in GUARDED])
def test_every_route_but_health_needs_the_key(keyed: Backend, method: str, path: str,
                                              body: Any) -> None:
    for authorization in REFUSED:
        r = call(keyed, method, path, body, authorization)
        assert r.status_code == 401, (authorization, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.headers["x-request-id"]  # refused inside the request context
    ok = call(keyed, method, path, body, f"Bearer {BACKEND_KEY}")
    assert ok.status_code == 200, ok.text
    # the scheme is case-insensitive, as RFC 7235 says
    assert call(keyed, method, path, body, f"bearer {BACKEND_KEY}").status_code == 200


def test_health_is_open_and_nothing_refused_reached_the_engine(keyed: Backend) -> None:
    r = httpx.get(keyed.url + "/health", timeout=5)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    before = keyed.state()["prefix_cache_queries"]
    for authorization in REFUSED:
        assert call(keyed, "POST", "/v1/completions", {**COMPLETION, "cache_salt": "forged"},
                    authorization).status_code == 401
    assert keyed.state()["prefix_cache_queries"] == before  # no lookup, forged salt or not
    # an unknown route does not tell a stranger it is unknown
    assert call(keyed, "GET", "/v1/nothing", None, None).status_code == 401
    assert call(keyed, "GET", "/v1/nothing", None, f"Bearer {BACKEND_KEY}").status_code == 404


async def test_the_middleware_refuses_before_reading_the_body() -> None:
    reached: list[str] = []
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope.get("path", scope["type"]))

    async def receive() -> dict[str, Any]:
        raise AssertionError("the body of a refused request was read")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    guard = ApiKeyMiddleware(app, "sk-k")

    def scope(path: str, authorization: bytes | None) -> dict[str, Any]:
        headers = [] if authorization is None else [(b"authorization", authorization)]
        return {"type": "http", "path": path, "method": "POST", "headers": headers}

    await guard(scope("/v1/completions", b"Bearer sk-nope"), receive, send)
    assert sent[0]["status"] == 401 and reached == []
    await guard(scope("/health", None), receive, send)
    await guard(scope("/v1/completions", b"Bearer sk-k"), receive, send)
    assert reached == ["/health", "/v1/completions"]
    await guard({"type": "lifespan"}, receive, send)  # not HTTP: passed through
    assert len(reached) == 3


def test_the_key_comes_from_the_flag_then_the_environment() -> None:
    assert resolve_api_key("sk-flag", False, {API_KEY_ENV: "sk-env"}) == "sk-flag"
    assert resolve_api_key(None, False, {API_KEY_ENV: "sk-env"}) == "sk-env"
    assert resolve_api_key(None, True, {API_KEY_ENV: "sk-env"}) is None  # explicitly open
    for flag, env in ((None, {}), (None, {API_KEY_ENV: ""}), ("", {})):
        with pytest.raises(ValueError, match="no API key"):
            resolve_api_key(flag, False, env)
    with pytest.raises(ValueError, match="not both"):
        resolve_api_key("sk-flag", True, {})
    with pytest.raises(ValueError, match="printable ASCII"):
        resolve_api_key("sk key", False, {})


def test_sluice_backend_refuses_to_start_without_a_key(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from sluice.cli import main

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert main(["backend", "--model", "tiny"]) == 2  # before the model loads
    err = capsys.readouterr().err
    assert "no API key" in err and "--no-api-key" in err
    assert main(["backend", "--model", "tiny", "--api-key", "k", "--no-api-key"]) == 2
    assert "not both" in capsys.readouterr().err
