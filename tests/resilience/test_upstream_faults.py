"""Real backends crash and hang under a gateway pool: SIGKILL mid-stream, SIGSTOP.

Each scenario ends with the leak check: no lease, slot, lent connection, probe or extra
asyncio task in the gateway, and no running request or held KV block in any backend.
"""

from __future__ import annotations

import signal
import time

import httpx

from tests.gateway.conftest import tenants_for_tests

from .conftest import (
    Replica,
    ThreadedGateway,
    assert_no_leaks,
    auth,
    chat,
    member_of,
    pool_config,
    stream_chat,
    tasks,
)


def post(gw: ThreadedGateway, body: dict[str, object]) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", json={**body, "stream": False},
                      headers=auth(), timeout=30)


def test_upstream_killed_mid_stream(replicas: list[Replica]) -> None:
    a, b = replicas
    with ThreadedGateway(pool_config([a.url, b.url]), tenants_for_tests()) as gw:
        for _ in range(2):
            assert post(gw, chat(4)).status_code == 200
        idle = tasks(gw)
        running = {"include_usage": True, "continuous_usage_stats": True}
        clients = [stream_chat(gw.url, chat(500, stream_options=running)) for _ in range(4)]
        for c in clients:
            assert c.first.wait(30)
        on_a = a.state()["running"]
        assert on_a == 2  # least-load spread them two and two
        killed = time.monotonic()
        a.kill()
        for c in clients:
            c.join(30)
        victims = [c for c in clients if c.error is not None]
        # failed requests are exactly those in flight on the killed server
        assert len(victims) == on_a
        for c in victims:
            at = next(t for t, e in c.events if isinstance(e, dict) and "error" in e)
            assert at - killed < 1.0  # the error event, not a hang until a timeout
            assert c.error == {"message": "the model 'm' broke off its answer",
                               "type": "server_error", "code": "upstream_error",
                               "param": None, "status": 502}
            assert c.events[-1][1] == "[DONE]"
        for c in clients:
            if c not in victims:
                assert c.events[-1][1] == "[DONE]" and c.failed is None
        ma = member_of(gw, a)
        assert ma.breaker.transitions["open"] == 1  # two failures: the threshold
        # usage settled for what was delivered: the victims' tokens, not their worst case
        ledger = gw.gateway.ledger
        assert ledger.by_key[("one", "m", "upstream_error")] == 2
        delivered = [max(e["usage"]["completion_tokens"] for _, e in c.events
                         if isinstance(e, dict) and e.get("usage")) for c in victims]
        assert all(0 < d < 500 for d in delivered)
        assert ledger.by_tenant["one"].completion_tokens == 2 * 4 + 2 * 500 + sum(delivered)
        # the next requests succeed on the healthy replica (a probe of the dead one after
        # the cooldown fails to connect, reopens its breaker and is retried on the other)
        for _ in range(3):
            assert post(gw, chat(4)).status_code == 200
        assert ma.breaker.state in ("open", "half_open")
        a.start()  # restarted on the same port
        while ma.breaker.remaining_cooldown() > 0:
            time.sleep(0.05)
        served = a.state()["generated_tokens"]
        assert post(gw, chat(4)).status_code == 200  # the probe, on the restarted replica
        assert a.state()["generated_tokens"] == served + 4
        assert ma.breaker.state == "closed" and ma.breaker.transitions["closed"] == 1
        metrics = httpx.get(gw.url + "/metrics").text
        assert f'sluice_gateway_breaker_state{{model="m",upstream="{a.url}"}} 0.0' in metrics
        assert (f'sluice_gateway_upstream_failures_total{{model="m",reason="disconnected",'
                f'upstream="{a.url}"}} 2.0') in metrics
        assert_no_leaks(gw, replicas, idle)


def test_upstream_hangs(replicas: list[Replica]) -> None:
    a, b = replicas
    cfg = pool_config([a.url, b.url], solo=a.url, first_byte_s=1.0, idle_s=1.0)
    with ThreadedGateway(cfg, tenants_for_tests()) as gw:
        for _ in range(2):
            assert post(gw, chat(4)).status_code == 200
        idle = tasks(gw)
        streaming = stream_chat(gw.url, chat(2000, model="solo"))
        assert streaming.first.wait(30)
        a.signal(signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            streaming.join(30)
            # the idle timeout ends the stream with its own error
            assert streaming.error is not None
            assert streaming.error["code"] == "upstream_idle_timeout"
            assert streaming.error["status"] == 504
            assert time.monotonic() - stopped < 10
            # a deadline shorter than the first-byte timeout wins, and the client is not
            # kept past it
            start = time.monotonic()
            hurried = post(gw, chat(4, model="solo", deadline_ms=300))
            waited = time.monotonic() - start
            assert hurried.status_code == 504
            assert hurried.json()["error"]["code"] == "deadline_exceeded"
            assert waited < 1.0  # the deadline (0.3 s) cut it, not the first-byte timeout
            # nothing can answer "solo": the first-byte timeout, 504
            late = post(gw, chat(4, model="solo"))
            assert late.status_code == 504
            assert late.json()["error"]["code"] == "upstream_first_byte_timeout"
            # the pool: a request that meets the hung server is retried on the other one
            for _ in range(2):
                resp = post(gw, chat(4))
                assert resp.status_code == 200
            failures = gw.gateway.metrics.failures
            assert failures[("solo", a.url, "first_byte_timeout")] == 1
            assert failures[("solo", a.url, "idle_timeout")] == 1
        finally:
            a.signal(signal.SIGCONT)
        assert_no_leaks(gw, replicas, idle)
