"""A model served by a pool of two scriptable upstreams: routing, retries on the other
server, the breaker opening, and the refusal when every breaker is open."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.config import (
    BreakerConfig,
    GatewayConfig,
    Listen,
    ModelEntry,
    ResilienceConfig,
    RetryConfig,
)
from gateway.errors import ConfigError
from tests.backend.server.conftest import free_port

from .conftest import ThreadedGateway, auth, tenants_for_tests
from .fake_backend import FakeBackend

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


def pool_config(urls: list[str], **entry: Any) -> GatewayConfig:
    return GatewayConfig(
        listen=Listen(port=free_port()), refresh_interval_s=3600,
        models=[ModelEntry(name="m", upstreams=urls, kind="sluice",  # type: ignore[arg-type]
                           tokenizer="upstream", upstream_model="fake-model", **entry)],
        resilience=ResilienceConfig(
            breaker=BreakerConfig(consecutive_failures=2, cooldown_s=60),
            retry=RetryConfig(budget_ratio=1.0, backoff_base_s=0.001)))


@pytest.fixture
def fakes() -> Iterator[tuple[FakeBackend, FakeBackend]]:
    with FakeBackend() as a, FakeBackend() as b:
        yield a, b


@pytest.fixture
def gw(fakes: tuple[FakeBackend, FakeBackend]) -> Iterator[ThreadedGateway]:
    a, b = fakes
    with ThreadedGateway(pool_config([a.url, b.url]), tenants_for_tests()) as g:
        yield g


def post(gw: ThreadedGateway, body: dict[str, Any] = CHAT) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=auth(), timeout=30)


def metric(gw: ThreadedGateway, line_start: str) -> float:
    text = httpx.get(gw.url + "/metrics").text
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_pool_config_forms() -> None:
    one = ModelEntry(name="m", upstream="http://127.0.0.1:1/v1")
    assert [m.url for m in one.members] == ["http://127.0.0.1:1"]
    pool = ModelEntry.model_validate({"name": "m", "kind": "sluice", "upstreams": [
        "http://a:1", {"url": "http://b:2/", "kind": "openai", "weight": 2}]})
    assert pool.upstream == "http://a:1"
    assert [(m.url, m.kind, m.weight) for m in pool.members] == [
        ("http://a:1", "sluice", 1.0), ("http://b:2", "openai", 2.0)]
    with pytest.raises(ValueError, match="either upstream"):
        ModelEntry.model_validate({"name": "m", "upstream": "http://a:1",
                                   "upstreams": ["http://b:1"]})
    from gateway.config import load_gateway_config

    with pytest.raises(ConfigError):
        load_gateway_config("/nonexistent.yaml")


def test_requests_spread_over_the_pool(gw: ThreadedGateway,
                                       fakes: tuple[FakeBackend, FakeBackend]) -> None:
    for _ in range(6):
        assert post(gw).status_code == 200
    assert len(fakes[0].bodies) == 3 and len(fakes[1].bodies) == 3


def test_a_5xx_is_retried_on_the_other_server_and_opens_its_breaker(
        gw: ThreadedGateway, fakes: tuple[FakeBackend, FakeBackend]) -> None:
    a, b = fakes
    a.mode = "500"
    for _ in range(4):
        resp = post(gw)
        assert resp.status_code == 200  # the client never sees the failing server
    # a failed twice (the threshold), then its breaker opened: b took everything
    assert len(a.bodies) == 2 and len(b.bodies) == 4
    assert metric(gw, 'sluice_gateway_breaker_state{model="m",upstream="' + a.url) == 2
    assert metric(gw, 'sluice_gateway_retries_total{model="m",outcome="retried"}') == 2
    assert metric(gw, 'sluice_gateway_upstream_failures_total{model="m",reason="http_500",'
                  'upstream="' + a.url + '"}') == 2
    b.mode = "500"  # b fails too: retried nowhere (a is open), its error goes out
    assert post(gw).status_code == 502
    assert post(gw).status_code == 502
    refused = post(gw)  # both open: refused at once, with the cooldown left
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "upstream_circuit_open"
    assert 58 <= int(refused.headers["retry-after"]) <= 60
    assert len(b.bodies) == 6
    gwo = gw.gateway
    assert not gwo.admission.live and not any(q.snapshot().slots_held for q in gwo.queues.values())


def test_a_4xx_is_never_retried(gw: ThreadedGateway,
                                fakes: tuple[FakeBackend, FakeBackend]) -> None:
    a, b = fakes
    a.mode = b.mode = "400"
    resp = post(gw)
    assert resp.status_code == 400
    assert len(a.bodies) + len(b.bodies) == 1
    assert metric(gw, 'sluice_gateway_breaker_state{model="m",upstream="' + a.url) == 0


def test_retry_after_keeps_a_server_out_of_routing(
        gw: ThreadedGateway, fakes: tuple[FakeBackend, FakeBackend]) -> None:
    a, b = fakes
    a.mode = "503"  # answers with retry-after: 7
    assert post(gw).status_code == 200
    a.mode = "ok"
    for _ in range(4):
        assert post(gw).status_code == 200
    assert len(a.bodies) == 1 and len(b.bodies) == 5


def test_a_dead_server_is_routed_around(fakes: tuple[FakeBackend, FakeBackend]) -> None:
    a, b = fakes
    with ThreadedGateway(pool_config([a.url, b.url]), tenants_for_tests()) as g:
        a.__exit__()  # connection refused from now on
        codes = [post(g).status_code for _ in range(5)]
        assert codes == [200] * 5
        assert metric(g, 'sluice_gateway_upstream_failures_total{model="m",reason="connect",'
                      'upstream="' + a.url + '"}') == 2
        ready = httpx.get(g.url + "/readyz").json()
        assert ready["status"] == "ready" and ready["checks"]["m"]["detail"].startswith("1/2")


def test_retries_and_breaker_moves_are_on_the_trace(
        fakes: tuple[FakeBackend, FakeBackend], monkeypatch: pytest.MonkeyPatch) -> None:
    from telemetry.bench.otlp_sink import OtlpReceiver
    from telemetry.config import TelemetryConfig, TracesConfig

    a, b = fakes
    a.mode = "500"
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    with OtlpReceiver() as rx:
        cfg = pool_config([a.url, b.url]).model_copy(update={"telemetry": TelemetryConfig(
            traces=TracesConfig(exporter="otlp", endpoint=rx.endpoint))})
        with ThreadedGateway(cfg, tenants_for_tests()) as g:
            for rid in ("first", "second"):
                resp = httpx.post(g.url + "/v1/chat/completions", json=CHAT, timeout=30,
                                  headers={**auth(), "x-request-id": rid})
                assert resp.status_code == 200

            def request_span(rid: str, spans: list[Any]) -> list[Any]:
                return [s for s in spans if s.kind == 2  # SERVER: the request span
                        and s.attributes.get("sluice.request.id") == rid]

            def upstream_spans(rid: str, spans: list[Any]) -> list[Any]:
                root = request_span(rid, spans)
                return [] if not root else sorted(
                    (s for s in spans if s.parent_span_id == root[0].span_id
                     and s.name in ("sluice.upstream", "sluice.retry.backoff")),
                    key=lambda s: s.start_ns)

            spans = rx.wait_for(lambda sp: len(upstream_spans("second", sp)) == 3, timeout=15)
    assert request_span("second", spans)[0].name == "chat m"
    first, backoff, second = upstream_spans("second", spans)
    assert first.kind == second.kind == 3  # CLIENT: each attempt is its own call
    # the server that answered was handed the second attempt's span as its parent
    assert b.headers[-1]["traceparent"].split("-")[1:3] == [second.trace_id, second.span_id]
    assert first.attributes["sluice.upstream.member"] == a.url
    assert first.attributes["sluice.attempt"] == 1
    assert first.attributes["error.type"] == "http_500"
    assert first.attributes["sluice.breaker.transition"] == "closed->open"
    assert backoff.name == "sluice.retry.backoff" and backoff.attributes["sluice.attempt"] == 2
    assert second.attributes["sluice.upstream.member"] == b.url
    assert second.attributes["sluice.attempt"] == 2
    assert second.attributes["http.response.status_code"] == 200
    assert "error.type" not in second.attributes


def test_prefix_routing_is_sticky_within_its_load_bound() -> None:
    from gateway.http_client import Pool
    from gateway.pool import Router, build_members
    from policies.breaker import BreakerPolicy

    entry = ModelEntry(name="m", upstreams=[f"http://127.0.0.1:{9000 + i}" for i in range(3)],
                       routing="prefix", load_bound=1.25)  # type: ignore[arg-type]
    pools = [Pool(m.url, max_connections=1, connect_s=1, read_s=1) for m in entry.members]
    members = build_members(entry, pools, BreakerPolicy())
    router = Router(entry, members)
    faq = [{"role": "user", "content": "the long shared document " * 20 + f"question {i}"}
           for i in range(6)]
    keys = [router.prefix_key("alpha", msgs) for msgs in ([m] for m in faq)]
    assert len(set(keys)) == 1  # the shared start is what is hashed
    home, _ = router.pick(100, keys[0])
    assert all(router.pick(100, k)[0] is home for k in keys)  # nothing in flight: sticky
    other = router.prefix_key("beta", [faq[0]])
    assert other != keys[0]  # tenants never share a key
    # load the home member past ⌈1.25 × average⌉ requests: the next one spills over
    home.inflight_requests = 3
    spilled, _ = router.pick(100, keys[0])
    assert spilled is not home
    home.inflight_requests = 1  # with another member busy too: ⌈1.25 × 4 / 3⌉ = 2, fits
    next(m for m in members if m is not home).inflight_requests = 2
    assert router.pick(100, keys[0])[0] is home
    assert router.prefix_key("alpha", "x") is not None
    least = Router(entry.model_copy(update={"routing": "least_load"}), members)
    assert least.prefix_key("alpha", "x") is None


def test_a_pin_is_routed_only_among_the_members_serving_its_revision() -> None:
    from gateway.http_client import Pool
    from gateway.pool import AllOpen, NoRevision, Router, build_members
    from policies.breaker import BreakerPolicy
    from protocol.versions import ServedVersions

    old, new = ServedVersions("a" * 40, "t", None, "e"), ServedVersions("d" * 40, "t", None, "e")
    entry = ModelEntry(name="m", upstreams=[f"http://127.0.0.1:{9000 + i}" for i in range(4)],
                       routing="least_load")  # type: ignore[arg-type]
    pools = [Pool(m.url, max_connections=1, connect_s=1, read_s=1) for m in entry.members]
    members = build_members(entry, pools, BreakerPolicy(consecutive_failures=1))
    for m, v in zip(members, (old, new, new, None), strict=True):
        m.versions = v  # the last one's are unknown (it did not answer its last read)
    router = Router(entry, members, refresh_s=7.0)
    assert router.serving(None) == members
    assert router.serving("d" * 8) == members[1:3] and router.serving("a" * 40) == members[:1]
    assert router.serving("d" * 6) == [] and router.serving("f" * 8) == []
    # least load among the new members only, however idle the others are
    members[1].inflight_tokens = 500
    assert router.pick(100, pin="d" * 8)[0] is members[2]
    members[2].inflight_tokens = 900
    assert router.pick(100, pin="d" * 8)[0] is members[1]
    # the old member takes its pins even when it is the busiest of all
    members[0].inflight_tokens = 10_000
    assert router.pick(100, pin="a" * 12)[0] is members[0]
    # an unpinned request may go anywhere: the idle member of unknown versions
    assert router.pick(100)[0] is members[3]
    # prefix routing ranks only the members serving the pin
    prefix = Router(entry.model_copy(update={"routing": "prefix"}), members)
    for i in range(20):
        key = prefix.prefix_key(f"tenant{i}", "a prompt")
        assert prefix.pick(100, key, pin="d" * 8)[0] in members[1:3]
    # a pin nobody serves: NoRevision, retry after the refresh interval
    with pytest.raises(NoRevision) as none:
        router.pick(100, pin="f" * 8)
    assert none.value.retry_after_s == 7.0
    # served, but its only member is open: the breaker's refusal, not NoRevision
    members[0].breaker.record(members[0].breaker.try_pass(), "failure")  # type: ignore[arg-type]
    with pytest.raises(AllOpen) as shut:
        router.pick(100, pin="a" * 8)
    assert not isinstance(shut.value, NoRevision) and shut.value.retry_after_s > 1.0
    # a pinned retry never leaves the pin's members
    with pytest.raises(AllOpen):
        router.pick(100, exclude=frozenset({members[1].key, members[2].key}), pin="d" * 8)


def _recovered_member_share(policy: Any) -> tuple[int, int, bool]:
    """Least-load routing right after one member's breaker went half-open → closed, on a
    fake loop clock (aiolimiter's): the other member is busy with 50 requests; 100 new ones
    arrive 10 ms apart and stay in flight. How many went to the recovered member in that
    first second, how many of the next 10 at once after ``ramp_s``, and whether it was
    still paced then."""
    import asyncio

    from gateway.http_client import Pool
    from gateway.pool import Router, build_members

    class FakeTimeLoop(asyncio.SelectorEventLoop):
        now = 1000.0

        def time(self) -> float:
            return self.now

    loop = FakeTimeLoop()

    async def main() -> tuple[int, int, bool]:
        entry = ModelEntry(name="m", upstreams=[f"http://127.0.0.1:{9000 + i}"
                                                for i in range(2)],
                           routing="least_load")  # type: ignore[arg-type]
        pools = [Pool(m.url, max_connections=1, connect_s=1, read_s=1) for m in entry.members]
        a, b = members = build_members(entry, pools, policy, loop.time)
        b.inflight_tokens, b.inflight_requests = 50 * 100, 50
        a.breaker.record(a.breaker.try_pass(), "failure")  # type: ignore[arg-type]
        assert a.breaker.state == "open"
        loop.now += policy.cooldown_s
        probe = a.breaker.try_pass()
        assert probe is not None and probe.probe
        a.breaker.record(probe, "success")
        assert a.breaker.state == "closed"
        router = Router(entry, members)

        def route(n: int, every_s: float) -> int:
            to_a = 0
            for _ in range(n):
                m, _ = router.pick(100)
                m.inflight_tokens += 100
                m.inflight_requests += 1
                to_a += m is a
                loop.now += every_s
            return to_a

        first = route(100, 0.01)
        loop.now += policy.ramp_s
        paced_after = a.paced() or a.ramp is not None
        return first, route(10, 0.0), paced_after

    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def test_a_member_whose_breaker_just_closed_is_ramped_not_flooded() -> None:
    """Side by side, the same arrivals: without a ramp (ramp_s=0, the behaviour before the
    ramp) the recovered member, idle, takes every new request until its load matches the
    busy one's: 75 of the 100 in its first second. With the default ramp (2 rps doubling
    each second for 10 s, aiolimiter) it takes 3; the rest go to the other member."""
    from policies.breaker import BreakerPolicy

    flood = _recovered_member_share(BreakerPolicy(consecutive_failures=1, ramp_s=0.0))
    assert flood == (75, 5, False)  # the first 50 straight, then in turn; unpaced
    ramped = _recovered_member_share(BreakerPolicy(consecutive_failures=1))
    assert ramped[0] == 3  # a burst of 2, then 2 per second
    # after ramp_s the ramp is gone and least load rules again: the idle member takes all
    assert ramped[1:] == (10, False)


def test_a_lone_member_is_routed_over_its_ramp_and_a_reopen_drops_the_ramp() -> None:
    import asyncio

    from gateway.http_client import Pool
    from gateway.pool import Router, build_members
    from policies.breaker import BreakerPolicy

    async def main() -> None:
        entry = ModelEntry(name="m", upstream="http://127.0.0.1:9000")  # type: ignore[arg-type]
        pools = [Pool(m.url, max_connections=1, connect_s=1, read_s=1) for m in entry.members]
        now = [100.0]
        policy = BreakerPolicy(consecutive_failures=1, cooldown_s=0.0)
        (lone,) = members = build_members(entry, pools, policy, lambda: now[0])
        router = Router(entry, members)

        def fail_then_close() -> None:
            lone.breaker.record(lone.breaker.try_pass(), "failure")  # type: ignore[arg-type]
            probe = lone.breaker.try_pass()  # cooldown 0: half-open at once
            assert probe is not None and probe.probe
            lone.breaker.record(probe, "success")

        fail_then_close()
        assert lone.ramp is not None
        # no other member: it takes every request, over its ramp (its capacity gate bounds it)
        assert all(router.pick(100)[0] is lone for _ in range(20))
        assert lone.paced()
        lone.breaker.record(lone.breaker.try_pass(), "failure")  # type: ignore[arg-type]
        assert lone.ramp is None  # open again: no ramp until the next close
        probe = lone.breaker.try_pass()
        assert probe is not None
        lone.breaker.record(probe, "success")
        assert lone.ramp is not None and not lone.paced()  # a fresh ramp, with room

    asyncio.run(main())
