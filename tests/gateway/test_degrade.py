"""Degradation rules: under load, batch requests are clamped, then shed before interactive
ones, and a tenant may be served by its fallback model; each is stamped on the response."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from gateway.config import (
    Capacity,
    DegradeConfig,
    FallbackConfig,
    GatewayConfig,
    Listen,
    ModelEntry,
    PriorityRange,
    TenantEntry,
    TenantsFile,
)
from gateway.tenants import hash_key
from policies.degrade import DegradeRules, decide
from tests.backend.server.conftest import free_port

from .conftest import TEST_KEY, ThreadedGateway, auth
from .fake_backend import FakeBackend


def test_rules_in_order() -> None:
    r = DegradeRules(batch_priority=7, clamp_at=0.5, clamp_max_tokens=10, shed_batch_at=0.8,
                     fallback_model="small", fallback_at=0.9)
    assert decide(r, 8, 0.4, 100) is None
    clamp = decide(r, 8, 0.6, 100)
    assert clamp is not None and clamp.action == "clamp" and clamp.max_tokens == 10
    assert clamp.describe(asked=100) == "clamp; max_tokens=10; requested=100; load=0.60"
    assert decide(r, 8, 0.6, 5) is None  # already within the clamp
    assert decide(r, 3, 0.85, 100) is None  # interactive keeps its tokens and its place
    shed = decide(r, 8, 0.85, 100)
    assert shed is not None and shed.action == "shed"
    fb = decide(r, 3, 0.95, 100)
    assert fb is not None and fb.action == "fallback" and fb.model == "small"
    assert decide(r, 3, 0.95, 100, pinned=True) is None  # a pin is never replaced


def entry(name: str, url: str) -> ModelEntry:
    return ModelEntry(name=name, upstream=url, kind="sluice", upstream_model="fake-model",
                      tokenizer="bytes", capacity=Capacity(kv_tokens=2000))


@pytest.fixture
def setup() -> Iterator[tuple[ThreadedGateway, FakeBackend, FakeBackend]]:
    tenants = TenantsFile(tenants=[TenantEntry(
        id="one", keys=[hash_key(TEST_KEY)], priority=PriorityRange(min=0, max=10, default=4),
        degrade=DegradeConfig(batch_priority=7, clamp_at=0.15, clamp_max_tokens=5,
                              shed_batch_at=0.3, fallback=FallbackConfig(model="small",
                                                                         at=0.5)))])
    with ExitStack() as stack:
        big = stack.enter_context(FakeBackend())
        small = stack.enter_context(FakeBackend())
        big.mode = "hold"
        cfg = GatewayConfig(listen=Listen(port=free_port()), refresh_interval_s=3600,
                            models=[entry("m", big.url), entry("small", small.url)])
        gw = stack.enter_context(ThreadedGateway(cfg, tenants))
        yield gw, big, small
        big.release.set()


def ask(gw: ThreadedGateway, priority: int, max_tokens: int,
        model: str = "m") -> tuple[int, dict[str, str], Any]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens, "priority": priority, "stream": True}
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, headers=auth(),
                      timeout=30) as resp:
        for line in resp.iter_lines():  # the first event is enough: the stream may hold
            if line.startswith("data: "):
                break
        return resp.status_code, dict(resp.headers), line


def test_batch_is_clamped_then_shed_and_the_fallback_serves(
        setup: tuple[ThreadedGateway, FakeBackend, FakeBackend]) -> None:
    import threading
    import time

    gw, big, small = setup
    held: list[threading.Thread] = []

    def read_all(tokens: int) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": tokens, "priority": 2, "stream": True}
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, headers=auth(),
                          timeout=30) as resp:
            for _ in resp.iter_lines():
                pass

    def hold(tokens: int) -> None:
        seen = len(big.bodies)
        t = threading.Thread(target=read_all, args=(tokens,), daemon=True)
        t.start()
        held.append(t)
        while len(big.bodies) == seen:
            time.sleep(0.005)
        time.sleep(0.05)  # its two chunks relayed: it holds its slot now

    hold(340)  # about 0.2 of the capacity in flight (worst cases: prompt + max_tokens)
    status, headers, _ = ask(gw, 8, 100)
    assert status == 200 and big.bodies[-1]["max_tokens"] == 5
    assert headers["x-sluice-degraded"].startswith("clamp; max_tokens=5; requested=100; load=0.")
    status, headers, _ = ask(gw, 2, 100)  # interactive: untouched
    assert status == 200 and "x-sluice-degraded" not in headers
    assert big.bodies[-1]["max_tokens"] == 100
    hold(340)  # about 0.4
    status, headers, _ = ask(gw, 8, 100)
    assert status == 503 and headers["x-sluice-degraded"].startswith("shed; class=batch")
    assert headers["retry-after"] == "1"
    status, headers, _ = ask(gw, 2, 100)
    assert status == 200 and "x-sluice-degraded" not in headers
    hold(340)  # about 0.6: the fallback model serves, and says so
    status, headers, _ = ask(gw, 2, 100)
    assert status == 200 and len(small.bodies) == 1
    assert headers["x-sluice-degraded"].startswith("fallback; model=small; requested=m")
    assert headers["x-sluice-resolved"].startswith("model=small;")
    big.release.set()
    for t in held:
        t.join(10)
