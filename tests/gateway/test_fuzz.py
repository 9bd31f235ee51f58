"""Fuzzing the request path: whatever the body and headers, no 500, no hang, and no upstream
connection or in-flight request left behind."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import TEST_KEY, ThreadedGateway, config_for, tenants_for_tests
from .fake_backend import FakeBackend

FIELDS = ["model", "messages", "prompt", "stream", "stream_options", "max_tokens",
          "max_completion_tokens", "temperature", "top_p", "n", "stop", "seed", "user",
          "presence_penalty", "logit_bias", "logprobs", "top_logprobs", "tools", "tool_choice",
          "response_format", "priority", "deadline_ms", "cache_salt", "top_k", "ignore_eos",
          "echo", "suffix", "best_of", "metadata", "unknown_field"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
good_messages = st.just([{"role": "user", "content": "hi"}])
base = st.fixed_dictionaries({
    "model": st.sampled_from(["m", "m@aaaaaaaa", "m@zz", "other", "", "m@"]),
    "messages": good_messages | json_values,
})
bodies = st.one_of(
    st.builds(lambda b, extra: {**b, **extra}, base,
              st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=4)),
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6),
    json_values,
)
header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=30).map(
    lambda s: s.strip() or "x")  # httpx itself refuses padded header values
headers = st.fixed_dictionaries({}, optional={
    "authorization": st.sampled_from([f"Bearer {TEST_KEY}", "Bearer nope", "Bearer", "x"])
    | header_text,
    "x-sluice-deadline-ms": header_text | st.integers(-5, 10**12).map(str),
    "x-request-id": header_text,
    "content-type": header_text,
})


@pytest.fixture(scope="module")
def env() -> Iterator[tuple[FakeBackend, ThreadedGateway, httpx.Client]]:
    with FakeBackend(chunks=3) as fake, ThreadedGateway(
            config_for(fake.url), tenants_for_tests(max_tokens=50, on_exceed="reject",
                                                    max_body_bytes=4096)) as gw, \
            httpx.Client(timeout=15) as client:
        yield fake, gw, client


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=bodies, hdrs=headers, path=st.sampled_from(["/v1/chat/completions",
                                                        "/v1/completions"]),
       raw=st.sampled_from([None, b"{", b"\xff\xfe", b"[]", b"x" * 5000, b"{}" * 3]))
def test_no_request_makes_the_gateway_fail(env: Any, body: Any, hdrs: dict[str, str],
                                           path: str, raw: bytes | None) -> None:
    _fake, gw, client = env
    content = raw if raw is not None and hdrs.get("x-request-id", "").startswith("a") \
        else json.dumps(body).encode()
    resp = client.post(gw.url + path, content=content,
                       headers={"authorization": f"Bearer {TEST_KEY}", **hdrs})
    assert resp.status_code in (200, 400, 401, 403, 404, 413, 504), resp.text  # 504: deadline
    if resp.status_code != 200:
        err = resp.json()["error"]
        assert isinstance(err["message"], str) and err["message"]
    assert resp.headers["x-request-id"]


def test_nothing_is_left_behind_after_the_fuzzing(env: Any) -> None:
    fake, gw, _ = env

    async def pool_state() -> tuple[int, int, int]:
        up = gw.gateway.upstreams["m"]
        # httpx (token counting) keeps its own idle connections; it has no public view
        side = up.client._transport._pool.connections
        assert all(c.is_idle() for c in side)
        return up.pool.idle_connections, up.pool.active, len(side)

    idle, busy, side = gw.call(pool_state())
    assert busy == 0, f"{busy} upstream connections still lent out"
    assert gw.gateway.metrics.inflight == 0
    assert fake.open_connections <= idle + side
