"""`sluice up --upstream URL --model-name NAME`: the gateway alone, in front of a server that
is already running (a bundled backend is recognised by the versions it reports)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.backend.server.conftest import BACKEND_KEY, Backend, start_backend

from .conftest import ALPHA, start_sluice_up


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    from modelfiles.tiny_model import ensure_tiny_model

    ensure_tiny_model()
    b = start_backend(tmp_path_factory.mktemp("external"), api_key=BACKEND_KEY)
    yield b
    b.stop()


def test_up_fronts_an_existing_backend(backend: Backend, tmp_path: Path) -> None:
    # its key in $SLUICE_BACKEND_API_KEY, as start_sluice_up sets it
    up = start_sluice_up(tmp_path, "--upstream", backend.url + "/v1",
                         "--model-name", "sluice-tiny", backend_key=backend.api_key)
    try:
        assert "starting the bundled backend" not in up.log()
        client = openai.OpenAI(base_url=up.url + "/v1", api_key=ALPHA, max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="sluice-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        revision = backend.state()["resolved"]["revision"]
        # recognised as a Sluice backend: its real revision is in the stamp
        assert f"revision={revision[:12]}" in raw.headers["x-sluice-resolved"]
        assert raw.parse().usage.completion_tokens <= 3
    finally:
        assert up.stop() == 0
    assert backend.proc.poll() is None  # an external upstream is not ours to stop


def test_up_needs_a_model_name_with_an_upstream(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="--model-name"):
        start_sluice_up(tmp_path, "--upstream", "http://127.0.0.1:9", timeout=30)


def test_stopping_up_stops_its_backend(tmp_path: Path) -> None:
    import httpx

    up = start_sluice_up(tmp_path)
    assert "sk-demo-alpha" in up.log() and "curl -s" in up.log()  # keys and a curl line
    assert httpx.get(up.backend_url + "/health").status_code == 200
    assert up.stop() == 0  # SIGTERM: a graceful exit
    with pytest.raises(httpx.ConnectError):
        httpx.get(up.backend_url + "/health")


def test_up_with_redis_keeps_quotas_in_redis(tmp_path: Path) -> None:
    import redis

    from tests.policies.conftest import RedisServer

    server = RedisServer(tmp_path)
    server.start()
    try:
        up = start_sluice_up(tmp_path, "--redis", server.url)
        try:
            assert f"quotas: redis {server.url}" in up.log()
            client = openai.OpenAI(base_url=up.url + "/v1", api_key=ALPHA, max_retries=0)
            raw = client.chat.completions.with_raw_response.create(
                model="sluice-tiny", messages=[{"role": "user", "content": "hi"}],
                max_tokens=3)
            assert raw.headers["x-ratelimit-limit-tokens"] == "500000"
            keys = {k.decode() for k in redis.Redis.from_url(server.url).keys("*")}
            assert "sluice:{alpha}:bucket" in keys and "sluice:{alpha}:budget" in keys
        finally:
            assert up.stop() == 0
    finally:
        server.stop()
