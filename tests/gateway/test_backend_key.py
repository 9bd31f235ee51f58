"""The gateway in front of a keyed bundled backend: it sends the key (``api_key_env``), and
`sluice up` makes a fresh one per run that nobody else has."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.backend.server.conftest import (
    BACKEND_KEY,
    GATEWAY_KEY_ENV,
    Backend,
    start_backend,
)

from .conftest import ALPHA, ThreadedGateway, auth, config_for, start_sluice_up, tenants_for_tests

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    from modelfiles.tiny_model import ensure_tiny_model

    ensure_tiny_model()
    b = start_backend(tmp_path_factory.mktemp("keyed"), api_key=BACKEND_KEY)
    yield b
    b.stop()


def test_the_gateway_sends_the_backends_key(keyed: Backend,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GATEWAY_KEY_ENV, BACKEND_KEY)
    cfg = config_for(keyed.url, upstream_model="sluice-tiny", tokenizer="local:tiny",
                     api_key_env=GATEWAY_KEY_ENV)
    with ThreadedGateway(cfg, tenants_for_tests()) as gw:
        for stream in (False, True):
            r = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": stream},
                           headers=auth(), timeout=60)
            assert r.status_code == 200, r.text
    # the same request straight to the backend, without the key, is refused
    direct = httpx.post(keyed.url + "/v1/chat/completions", timeout=30,
                        json={**CHAT, "model": "sluice-tiny"})
    assert direct.status_code == 401


def test_a_gateway_without_the_key_cannot_use_the_backend(keyed: Backend) -> None:
    cfg = config_for(keyed.url, upstream_model="sluice-tiny", tokenizer="local:tiny")
    with ThreadedGateway(cfg, tenants_for_tests()) as gw:
        r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=auth(), timeout=60)
    # its versions cannot be read (/v1/models is 401): "not reachable", never served
    assert r.status_code == 503, r.text


def test_sluice_up_keys_its_backend_with_a_fresh_key(tmp_path: Path) -> None:
    from modelfiles.tiny_model import ensure_tiny_model

    ensure_tiny_model()
    up = start_sluice_up(tmp_path, backend_key=None)  # no $SLUICE_BACKEND_API_KEY: made
    try:
        r = httpx.post(up.url + "/v1/chat/completions", headers=auth(ALPHA), timeout=60,
                       json={**CHAT, "model": "sluice-tiny"})
        assert r.status_code == 200, r.text  # the gateway has the key
        assert httpx.get(up.backend_url + "/health", timeout=5).status_code == 200
        for headers in ({}, {"authorization": f"Bearer {BACKEND_KEY}"},
                        {"authorization": f"Bearer {ALPHA}"}):
            for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/state")):
                direct = httpx.request(method, up.backend_url + path, headers=headers,
                                       json={**CHAT, "model": "sluice-tiny"}, timeout=30)
                assert direct.status_code == 401, (headers, path)
        assert "Bearer" not in up.log().replace(f"Bearer {ALPHA}", "")  # only the tenant's
    finally:
        assert up.stop() == 0
