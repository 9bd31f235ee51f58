"""Admission through the gateway: worst-case reservations, 429s with honest Retry-After,
rate headers that really go down, settlement on every exit, fail open and closed."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from gateway.config import (
    Caps,
    GatewayConfig,
    PriorityRange,
    QuotasConfig,
    StoreConfig,
    TenantEntry,
    TenantsFile,
)
from gateway.tenants import hash_key
from tests.policies.conftest import RedisServer

from .conftest import TEST_KEY, ThreadedGateway, auth, config_for
from .fake_backend import FakeBackend
from .stage_kit import VERSIONS

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 10}


def tenants(fail_mode: str = "closed", **quotas: Any) -> TenantsFile:
    return TenantsFile(tenants=[TenantEntry(
        id="one", keys=[hash_key(TEST_KEY)], priority=PriorityRange(),
        caps=Caps(), quotas=QuotasConfig(**quotas), fail_mode=fail_mode)])  # type: ignore[arg-type]


def with_store(cfg: GatewayConfig, url: str | None, **extra: Any) -> GatewayConfig:
    return cfg.model_copy(update={"store": StoreConfig(url=url, **extra)})


@pytest.fixture
def fake() -> Iterator[FakeBackend]:
    with FakeBackend() as f:
        yield f


def post(gw: ThreadedGateway, body: dict[str, Any] = CHAT) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=auth(), timeout=30)


def test_tokens_per_minute_denies_with_the_exact_wait(fake: FakeBackend) -> None:
    # worst case per request: prompt (tokenized by the fake: 5) + max_tokens 10 = 15
    with ThreadedGateway(config_for(fake.url), tenants(tokens_per_minute=40)) as gw:
        first = post(gw)
        assert first.status_code == 200
        assert first.headers["x-ratelimit-limit-tokens"] == "40"
        left = int(first.headers["x-ratelimit-remaining-tokens"])
        assert left <= 40 - 15 + 1  # the reservation really took the worst case
        # the fake generated 5 of the 10 reserved: the refund comes back
        time.sleep(0.05)
        second = post(gw)
        assert int(second.headers["x-ratelimit-remaining-tokens"]) >= left - 15 + 5 - 1
        while (r := post(gw)).status_code == 200:
            pass
        assert r.status_code == 429
        err = r.json()["error"]
        assert err["code"] == "rate_limit_exceeded" and err["param"] == "tokens_per_minute"
        wait_ms = int(r.headers["retry-after-ms"])
        assert 0 < wait_ms <= 15 / (40 / 60) * 1000 + 50  # at most a full refill of 15
        assert r.headers["retry-after"] == str(-(-wait_ms // 1000))
        assert r.headers["x-should-retry"] == "true"
        assert "x-sluice-resolved" in r.headers  # stamped: refused after resolution
        assert gw.gateway.admission.rejects[("one", "tokens_per_minute")] == 1


def test_a_budget_spent_until_tomorrow_says_do_not_retry(fake: FakeBackend) -> None:
    with ThreadedGateway(config_for(fake.url), tenants(tokens_per_day=20)) as gw:
        assert post(gw).status_code == 200
        r = post(gw)
        assert r.status_code == 429 and r.json()["error"]["param"] == "tokens_per_day"
        assert r.headers["x-should-retry"] == "false"
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=TEST_KEY, max_retries=3)
        before = gw.gateway.metrics.responses.get("/v1/chat/completions", "one", "429")
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(**CHAT)
        after = gw.gateway.metrics.responses.get("/v1/chat/completions", "one", "429")
        assert after - before == 1  # the SDK honoured x-should-retry: false


def test_the_openai_sdk_waits_as_told_and_succeeds(fake: FakeBackend) -> None:
    # worst case 5 + 100 = 105 and the answer really is 3 + 100: after the first request the
    # bucket holds ~97 of 200 and refills at 200/60 per second: the second waits ~2.4 s
    fake.chunks = 100
    body = {**CHAT, "max_tokens": 100}
    with ThreadedGateway(config_for(fake.url), tenants(tokens_per_minute=200)) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=TEST_KEY, max_retries=3)
        client.chat.completions.create(**body)
        start = time.monotonic()
        out = client.chat.completions.create(**body)
        waited = time.monotonic() - start
        assert out.choices[0].message.content
        assert gw.gateway.metrics.responses.get("/v1/chat/completions", "one", "429") >= 1
        assert 0.5 < waited < 5


def test_a_cancelled_stream_releases_its_lease(fake: FakeBackend) -> None:
    fake.mode = "hold"
    with ThreadedGateway(config_for(fake.url), tenants(max_concurrency=1)) as gw:
        with httpx.stream("POST", gw.url + "/v1/chat/completions", headers=auth(),
                          json={**CHAT, "stream": True}, timeout=30) as resp:
            lines = resp.iter_lines()  # kept: leaving the loop below must not close it
            for line in lines:
                if line.startswith("data: {"):
                    break
            busy = post(gw)
            assert busy.status_code == 429
            assert busy.json()["error"]["param"] == "max_concurrency"
        fake.mode = "ok"
        deadline = time.monotonic() + 5
        while (r := post(gw)).status_code == 429 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert r.status_code == 200
        assert not gw.gateway.admission.live


def test_upstream_failure_refunds_everything(fake: FakeBackend) -> None:
    fake.mode = "500"
    with ThreadedGateway(config_for(fake.url), tenants(tokens_per_minute=1000)) as gw:
        assert post(gw).status_code == 502
        fake.mode = "ok"
        ok = post(gw)
        # the failed request cost nothing: only this one's 15 is reserved
        assert int(ok.headers["x-ratelimit-remaining-tokens"]) >= 1000 - 15


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis-gw"))
    server.start()
    yield server
    server.stop()


def test_redis_outage_fail_closed_and_open_then_recovery(
        fake: FakeBackend, redis: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    # two replicas salt alike only with one shared key: without it the gateway refuses
    monkeypatch.setenv("SLUICE_CACHE_SALT_KEY", "k" * 32)
    ts = TenantsFile(tenants=[
        TenantEntry(id="closed", keys=[hash_key("sk-closed")], fail_mode="closed",
                    quotas=QuotasConfig(requests_per_minute=1000)),
        TenantEntry(id="open", keys=[hash_key("sk-open")], fail_mode="open",
                    quotas=QuotasConfig(requests_per_minute=4)),
    ])
    cfg = with_store(config_for(fake.url), redis.url, replicas=2)

    def call(key: str) -> httpx.Response:
        return httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30,
                          headers={"authorization": f"Bearer {key}"})

    with ThreadedGateway(cfg, ts) as gw:
        assert call("sk-closed").status_code == 200
        assert httpx.get(gw.url + "/readyz").status_code == 200
        redis.stop()
        try:
            start = time.monotonic()
            down = call("sk-closed")
            assert time.monotonic() - start < 2  # store calls have tight timeouts
            assert down.status_code == 503 and down.headers["retry-after"] == "1"
            assert down.json()["error"]["code"] == "store_unavailable"
            # open: served within the local share, 4 per minute / 2 replicas = 2
            codes = [call("sk-open").status_code for _ in range(3)]
            assert codes == [200, 200, 429]
            assert gw.gateway.admission.fail_open["open"] == 2
            time.sleep(1.1)
            assert httpx.get(gw.url + "/readyz").status_code == 503
        finally:
            redis.start()
        deadline = time.monotonic() + 10
        while (r := call("sk-closed")).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert r.status_code == 200  # recovered by itself


def test_usage_is_shared_by_replicas_through_redis(fake: FakeBackend,
                                                   redis: RedisServer) -> None:
    cfg = with_store(config_for(fake.url), redis.url)
    ts = tenants(requests_per_minute=3)
    ts = TenantsFile(tenants=[ts.tenants[0].model_copy(update={"id": f"shared{time.time_ns()}"})])
    with ThreadedGateway(cfg, ts) as a, ThreadedGateway(
            cfg.model_copy(update={"listen": cfg.listen.model_copy(update={"port": 0})}),
            ts) as b:
        codes = [post(g).status_code for g in (a, b, a, b)]
    assert codes == [200, 200, 200, 429]


def test_a_repeated_x_request_id_is_a_new_attempt(fake: FakeBackend) -> None:
    with ThreadedGateway(config_for(fake.url), tenants(tokens_per_minute=1000)) as gw:
        for _ in range(3):
            r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30,
                           headers={**auth(), "x-request-id": "same-id"})
            assert r.status_code == 200 and r.headers["x-request-id"] == "same-id"
        assert gw.gateway.ledger.by_tenant["one"].requests == 3  # each settled once
        assert not gw.gateway.admission.live


SLOW_S = 1.8  # how long the tenant's requests hold their slot (the figure)


def answer_after(fake: FakeBackend, seconds: float) -> None:
    """The stalled fake answers the next request ``seconds`` after it arrives."""
    fake.release.clear()
    seen = len(fake.bodies)

    def upstream_work() -> None:
        deadline = time.monotonic() + 20
        while len(fake.bodies) == seen and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(seconds)  # the upstream generating, not the test waiting
        fake.release.set()

    threading.Thread(target=upstream_work, daemon=True).start()


def test_a_concurrency_429_says_when_the_running_request_ends(
        fake: FakeBackend, redis: RedisServer) -> None:
    """#21: at max_concurrency the wait is when the running request is predicted to end
    (this tenant's requests hold their slot ~1.8 s), not when its 30 s lease would expire,
    so the SDK's own retry gets in as soon as the slot frees."""
    fake.mode = "stall"
    fake.release.set()
    tid = f"conc{time.time_ns()}"  # tenants and keys live in the module's Redis: fresh ones
    key, warm_key = f"sk-{tid}", f"sk-warm-{tid}"
    ts = TenantsFile(tenants=[
        TenantEntry(id=tid, keys=[hash_key(key)], quotas=QuotasConfig(max_concurrency=1)),
        TenantEntry(id=f"warm-{tid}", keys=[hash_key(warm_key)]),
    ])

    def call(gw: ThreadedGateway, key: str = key) -> httpx.Response:
        return httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=auth(key),
                          timeout=30)

    with ThreadedGateway(with_store(config_for(fake.url), redis.url), ts) as gw:
        # Warm up the gateway (upstream connections, tokenizer) on another tenant, so that
        # this tenant's history is only its own slow requests.
        assert call(gw, warm_key).status_code == 200
        answer_after(fake, SLOW_S)
        history = call(gw)
        assert history.status_code == 200, history.text  # held the slot ~1.8 s

        answer_after(fake, SLOW_S)
        arrived = len(fake.bodies)
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(call, gw)
            deadline = time.monotonic() + 10
            while len(fake.bodies) == arrived and time.monotonic() < deadline:
                time.sleep(0.005)
            assert len(fake.bodies) > arrived, "the running request never reached upstream"

            busy = call(gw)
            assert busy.status_code == 429
            assert busy.json()["error"]["param"] == "max_concurrency"
            wait_ms = int(busy.headers["retry-after-ms"])
            assert 100 <= wait_ms <= 3000  # was the lease's ~30,000
            assert busy.headers["retry-after"] == str(-(-wait_ms // 1000))
            assert int(busy.headers["retry-after"]) <= 3

            client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key)  # 2 retries
            refused = gw.gateway.metrics.responses.get("/v1/chat/completions", tid, "429")
            start = time.monotonic()
            out = client.chat.completions.create(**CHAT)
            sdk_s = time.monotonic() - start
            assert out.choices[0].message.content
            assert running.result(timeout=30).status_code == 200
        # the SDK was refused first and came back when told
        assert gw.gateway.metrics.responses.get("/v1/chat/completions", tid, "429") > refused
        print(f"\nmax_concurrency retry-after-ms {wait_ms}, retry-after "
              f"{busy.headers['retry-after']}; SDK succeeded in {sdk_s:.2f} s")
        assert sdk_s < 4.0


def test_the_worst_case_counts_all_n_choices_and_a_refusal_names_it(fake: FakeBackend) -> None:
    # prompt 5 (the fake's count) + max_tokens 500 fits 1500 tokens per minute; with n = 4
    # the upstream may generate 4 × 500: that can never fit, and the refusal says why
    cfg = config_for(fake.url, kind="openai", versions=VERSIONS, supports=["n"])
    with ThreadedGateway(cfg, tenants(tokens_per_minute=1500)) as gw:
        assert post(gw, {**CHAT, "max_tokens": 500}).status_code == 200
        refused = post(gw, {**CHAT, "max_tokens": 500, "n": 4})
        assert refused.status_code == 429, refused.text
        err = refused.json()["error"]
        assert err["param"] == "tokens_per_minute"
        assert "(prompt 5 + 4 × max_tokens 500 = 2005 tokens at most) can never fit" \
            in err["message"], err["message"]
        assert refused.headers["x-should-retry"] == "false"
