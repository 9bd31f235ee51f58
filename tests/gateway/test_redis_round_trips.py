"""What one admitted request costs in Redis: exactly four round trips (reserve, the
capacity gate's slot, its release, the settlement), each one EVALSHA; the renewal beat one
per tenant. Counted by Redis itself (INFO commandstats), through a real gateway."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from gateway.config import Capacity, QuotasConfig, StoreConfig, TenantEntry, TenantsFile
from gateway.tenants import hash_key
from tests.policies.conftest import RedisServer

from .conftest import TEST_KEY, ThreadedGateway, auth, config_for
from .fake_backend import FakeBackend

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 10}
REQUESTS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path_factory.mktemp("redis-rt"))
    s.start()
    yield s
    s.stop()


def calls(r: redis.Redis) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): int(v["calls"])
            for k, v in r.info("commandstats").items()}


def settled(gw: ThreadedGateway, r: redis.Redis) -> bool:
    adm = gw.gateway.admission
    return not adm.live and not adm._settling and not r.keys("*:leases") \
        and not r.keys("*:slots")


def test_an_admitted_request_is_four_evalsha(server: RedisServer) -> None:
    r = redis.Redis.from_url(server.url)
    ts = TenantsFile(tenants=[TenantEntry(
        id="rt", keys=[hash_key(TEST_KEY)],
        quotas=QuotasConfig(tokens_per_minute=10**6, requests_per_minute=10**5,
                            tokens_per_day=10**9, max_concurrency=100))])
    with FakeBackend() as fake:
        cfg = config_for(fake.url, kind="openai",
                         capacity=Capacity(kv_tokens=100_000, max_seqs=64))
        cfg = cfg.model_copy(update={"store": StoreConfig(url=server.url)})
        with ThreadedGateway(cfg, ts) as gw:
            url = gw.url + "/v1/chat/completions"
            assert httpx.post(url, json=CHAT, headers=auth(), timeout=30).status_code == 200
            deadline = time.monotonic() + 20
            while not settled(gw, r) and time.monotonic() < deadline:
                time.sleep(0.02)
            before = calls(r)
            for _ in range(REQUESTS):
                assert httpx.post(url, json=CHAT, headers=auth(), timeout=30).status_code == 200
            deadline = time.monotonic() + 20
            while (calls(r).get("evalsha", 0) - before.get("evalsha", 0) < 4 * REQUESTS
                   or not settled(gw, r)) and time.monotonic() < deadline:
                time.sleep(0.02)
            after = calls(r)
            delta = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    assert delta["evalsha"] == 4 * REQUESTS, delta
    # nothing else on the request path: the registry's version poll (GET) and this test's
    # own reads are the only other commands
    others = {k for k in delta if k not in ("evalsha", "get", "info", "keys", "ping")}
    script_inner = {"hincrby", "pexpire", "hset", "hget", "hmget", "time", "zscore", "zadd",
                    "zrangebyscore", "pttl", "zcount", "hexists", "zrem", "hdel", "pexpireat",
                    "zcard", "zrange", "spublish", "publish", "hkeys", "zremrangebyrank",
                    "hgetall", "hincrbyfloat"}
    assert others <= script_inner, others - script_inner
    # the TTL refreshes cut: PEXPIRE at most 7 per request (the trio of a tenant's lease keys,
    # recreated when they emptied; the bucket; the gate's two): 8 before the budget and
    # bucket writes were folded (and the renew beat dropped its three per lease)
    assert delta.get("pexpire", 0) <= 7 * REQUESTS, delta
