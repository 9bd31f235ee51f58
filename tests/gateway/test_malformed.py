"""Malformed input through a real gateway: a 400 naming the field or header, never a 500.

The model counts tokens with its own tokenizer in the gateway (``local:tiny``), so a body
that got past parsing would reach the chat template and the tokenizer (where deep nesting
overflowed the stack, and a lone surrogate could not be encoded).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .conftest import TEST_KEY, ThreadedGateway, config_for, tenants_for_tests
from .fake_backend import FakeBackend

SURROGATE = b"\xed\xa0\x80"  # U+D800 encoded as if it were a character: not UTF-8
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def env() -> Iterator[tuple[ThreadedGateway, httpx.Client]]:
    with FakeBackend() as fake, ThreadedGateway(
            config_for(fake.url, kind="openai", tokenizer="local:tiny"),
            tenants_for_tests()) as gw, httpx.Client(base_url=gw.url, timeout=30) as client:
        yield gw, client


def post(client: httpx.Client, path: str, body: bytes,
         headers: dict[str, Any] | None = None) -> httpx.Response:
    return client.post(path, content=body, headers={"authorization": f"Bearer {TEST_KEY}",
                                                     "content-type": "application/json",
                                                     **(headers or {})})


def refused(r: httpx.Response, param: str | None, code: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", code, param)
    assert r.headers["x-request-id"]
    return str(err["message"])


def chat_with(content: bytes) -> bytes:
    return b'{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": ' \
        + content + b"}]}"


@pytest.mark.parametrize(("path", "body", "param"), [
    (COMPLETIONS, b'{"model": "m", "max_tokens": 2, "prompt": "a\\ud800b"}', "prompt"),
    (COMPLETIONS, b'{"model": "m", "max_tokens": 2, "prompt": "a' + SURROGATE + b'b"}',
     "prompt"),
    (CHAT, chat_with(b'"\\ud800"'), "messages[0].content"),
    (CHAT, chat_with(b'"' + SURROGATE + b'"'), "messages[0].content"),
    (CHAT, chat_with(b'[{"type": "text", "text": "\\udfff"}]'), "messages[0].content[0].text"),
])
def test_lone_surrogates_are_a_400_naming_the_field(env: Any, path: str, body: bytes,
                                                    param: str) -> None:
    _gw, client = env
    message = refused(post(client, path, body), param, "invalid_unicode")
    assert param in message


@pytest.mark.parametrize("depth", [65, 500, 700, 950])
def test_deep_nesting_is_a_400_before_the_tokenizer(env: Any, depth: int) -> None:
    _gw, client = env
    content = b"[" * depth + b'"x"' + b"]" * depth
    message = refused(post(client, CHAT, chat_with(content)), None, "invalid_json")
    assert "deeper than 64" in message


@pytest.mark.parametrize("value", [b"9" * 5000, b"\xb2", b"1\xb2", b"9" * 19, b"0", b"-1",
                                   b"1e3", b"12ms"])
def test_a_bad_deadline_header_is_a_400_naming_it(env: Any, value: bytes) -> None:
    _gw, client = env
    body = chat_with(b'"hi"')
    r = post(client, CHAT, body, {"x-sluice-deadline-ms": value})
    assert "x-sluice-deadline-ms" in refused(r, "x-sluice-deadline-ms", "invalid_value")


@pytest.mark.parametrize("field", ["deadline_ms", "max_tokens", "priority", "seed"])
def test_integers_beyond_int64_are_a_400(env: Any, field: str) -> None:
    _gw, client = env  # a deadline_ms of 10**400 overflowed a float: a 500
    for big in (10**400, 2**63):
        body = b'{"model": "m", "prompt": "x", "%s": %d}' % (field.encode(), big)
        refused(post(client, COMPLETIONS, body), field, "invalid_value")


def test_good_input_still_passes_and_nothing_is_left(env: Any) -> None:
    gw, client = env
    ok = post(client, CHAT, chat_with(b'"caf\\u00e9 \\ud83d\\ude00 \xf0\x9f\x98\x80"'),
              {"x-sluice-deadline-ms": b"60000"})
    assert ok.status_code == 200, ok.text
    nested = b"[" * 30 + b'{"type": "text", "text": "x"}' + b"]" * 30
    r = post(client, CHAT, chat_with(nested))  # shallow enough: the template's own 400
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    deadline = time.monotonic() + 10  # a request ends (inflight -= 1) just after answering
    while gw.gateway.metrics.inflight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gw.gateway.metrics.inflight == 0


class StubAnswer:
    """An upstream's error answer, as error_from reads it."""

    def __init__(self, status: int, retry_after: str) -> None:
        self.status = status
        self._retry_after = retry_after

    async def read(self, limit: int) -> bytes:
        return b'{"error": {"message": "busy"}}'

    def header(self, name: str) -> str | None:
        return self._retry_after if name == "retry-after" else None


@pytest.mark.parametrize("status", [429, 503])
@pytest.mark.parametrize("value", ["\u00b2", "9" * 5000, "9" * 400, "-3", "1.5", "soon"])
def test_an_upstreams_bad_retry_after_is_ignored(status: int, value: str) -> None:
    import asyncio

    from gateway.upstream import UPSTREAM_RETRY_AFTER_S, error_from

    err = asyncio.run(error_from(StubAnswer(status, value), "m"))  # type: ignore[arg-type]
    assert err.status == status
    assert err.retry_after_s == (UPSTREAM_RETRY_AFTER_S if status == 503 else None)
    err.headers()  # renders (an infinite wait could not)
    good = asyncio.run(error_from(StubAnswer(status, "7"), "m"))  # type: ignore[arg-type]
    assert good.retry_after_s == 7.0
