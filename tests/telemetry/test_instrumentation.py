"""An OpenTelemetry instrumentation library's spans land in the gateway's traces: the
request span is the current span while the gateway serves a request, so the redis
instrumentation's span for the admission script is its child (docs/observability.md)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import redis
from opentelemetry.instrumentation.redis import RedisInstrumentor

from telemetry.bench.otlp_sink import OtlpReceiver, ReceivedSpan
from tests.gateway.conftest import ThreadedGateway, auth, config_for
from tests.gateway.fake_backend import FakeBackend
from tests.gateway.test_admission import with_store
from tests.policies.conftest import RedisServer
from tests.telemetry.test_gateway_telemetry import CHAT, tenants, traced

SERVER = 2


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis-instrumented"))
    server.start()
    yield server
    server.stop()


def test_redis_instrumentation_spans_join_the_requests_trace(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    with redis.Redis.from_url(redis_server.url) as r:
        r.flushall()
    with FakeBackend() as fake, OtlpReceiver() as rx:
        cfg = traced(with_store(config_for(fake.url), redis_server.url), rx.endpoint)
        with ThreadedGateway(cfg, tenants()) as g:
            provider = g.gateway.telemetry.provider
            assert provider is not None
            RedisInstrumentor().instrument(tracer_provider=provider)
            try:
                resp = httpx.post(g.url + "/v1/chat/completions", json=CHAT,
                                  headers={**auth(), "x-request-id": "instrumented"}, timeout=30)
                assert resp.status_code == 200

                def ready(spans: list[ReceivedSpan]) -> bool:
                    root = [s for s in spans if s.kind == SERVER
                            and s.attributes.get("sluice.request.id") == "instrumented"]
                    return bool(root) and any(
                        s.trace_id == root[0].trace_id and s.attributes.get("db.system")
                        == "redis" for s in spans)

                spans = rx.wait_for(ready, timeout=20)
            finally:
                RedisInstrumentor().uninstrument()
    root = next(s for s in spans if s.kind == SERVER
                and s.attributes.get("sluice.request.id") == "instrumented")
    mine = [s for s in spans if s.trace_id == root.trace_id
            and s.attributes.get("db.system") == "redis"]
    assert mine, "no redis span in the request's trace"
    ids = {s.span_id for s in spans if s.trace_id == root.trace_id}
    for s in mine:  # children of the request span (or of a span in it), never roots
        assert s.parent_span_id in ids
    assert any(s.parent_span_id == root.span_id for s in mine)
    assert root.name == "chat m"
