"""The admin API validates strictly and never stores what it refuses; a bad record already in
Redis (an older version's, or written by hand) is skipped, never a 500, on every replica."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from gateway.config import GatewayConfig
from policies.tenant_store import canonical
from tests.policies.conftest import RedisServer

from .conftest import TEST_KEY, ThreadedGateway, config_for
from .fake_backend import FakeBackend
from .test_admin import OPERATOR, PROPAGATION_S, Admin, chat, error, redis_dump, replica, within
from .test_admission import with_store


@pytest.fixture(autouse=True)
def operator_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_ADMIN_KEY", OPERATOR)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis-admin-validation"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def shared(redis_server: RedisServer) -> Iterator[GatewayConfig]:
    """A config on a freshly emptied Redis, in front of a fake backend."""
    with redis.Redis.from_url(redis_server.url) as r:
        r.flushall()
    with FakeBackend() as fake:
        yield with_store(config_for(fake.url), redis_server.url)


def raw(admin: Admin, method: str, path: str, content: bytes) -> httpx.Response:
    return admin(method, path, content=content)


BIG = b"1" + b"0" * 400
REFUSED: list[tuple[str, str, bytes, str | None]] = [
    # method, path, body, the param named
    ("PATCH", "/acme", b'{"weight": 1e999}', "weight"),
    ("PATCH", "/acme", b'{"weight": Infinity}', "weight"),
    ("PATCH", "/acme", b'{"weight": NaN}', "weight"),
    ("PATCH", "/acme", b'{"weight": 0.0001}', "weight"),
    ("PATCH", "/acme", b'{"models": ["\\udc80"]}', "models[0]"),
    ("PATCH", "/acme", b'{"models": ["\xed\xb2\x80"]}', "models[0]"),
    ("PATCH", "/acme", b'{"models": ["m@rev"]}', "models[0]"),
    ("PATCH", "/acme", b'{"models": [" m"]}', "models[0]"),
    ("PATCH", "/acme", json.dumps({"models": ["m"] * 1025}).encode(), "models"),
    ("PATCH", "/acme", b'{"name": "\\ud800"}', "name"),
    ("PATCH", "/acme", b'{"name": "a\\nb"}', "name"),
    ("PATCH", "/acme", json.dumps({"name": "n" * 257}).encode(), "name"),
    ("PATCH", "/acme", b'{"quotas": {"tokens_per_minute": ' + BIG + b"}}",
     "quotas.tokens_per_minute"),
    ("PATCH", "/acme", b'{"quotas": {"tokens_per_day": 1000000000000001}}',
     "quotas.tokens_per_day"),
    ("PATCH", "/acme", b'{"quotas": {"max_concurrency": 1000001}}', "quotas.max_concurrency"),
    ("PATCH", "/acme", b'{"quotas": {"requests_per_minute": 5.0}}',
     "quotas.requests_per_minute"),
    ("PATCH", "/acme", b'{"quotas": {"requests_per_minute": "5"}}',
     "quotas.requests_per_minute"),
    ("PATCH", "/acme", b'{"quotas": {"max_queued": true}}', "quotas.max_queued"),
    ("PATCH", "/acme", b'{"caps": {"max_tokens": ' + BIG + b"}}", "caps.max_tokens"),
    ("PATCH", "/acme", b'{"priority": {"min": -' + BIG + b"}}", "priority.min"),
    ("PATCH", "/acme", b'{"degrade": {"clamp_at": 1e999}}', "degrade.clamp_at"),
    ("PATCH", "/acme", b'{"degrade": {"fallback": {"model": "\\udfff"}}}',
     "degrade.fallback.model"),
    ("PATCH", "/acme", b'{"name": ' + b"[" * 100 + b"]" * 100 + b"}", None),
    ("POST", "", b'{"id": "abc\\n"}', "id"),
    ("POST", "", b'{"id": "\\udc80"}', "id"),
    ("POST", "", b'{"id": "x", "name": "\\udc80"}', "name"),
    ("POST", "", b'{"id": "x", "\\udc80": 1}', None),
    ("POST", "", b'{"id": "x", "weight": 1e999}', "weight"),
    ("POST", "", b"[" * 1000 + b"]" * 1000, None),
    ("POST", "/acme/keys", b'{"role": ' + b"[" * 1000 + b"]" * 1000 + b"}", None),
]


def test_what_is_refused_is_never_stored(shared: GatewayConfig,
                                         redis_server: RedisServer) -> None:
    with replica(shared) as a, replica(shared) as b:
        op = Admin(a)
        assert op("POST", "", {"id": "acme", "models": ["m"]}).status_code == 201
        before = op("GET", "/acme").json()
        dump = redis_dump(redis_server.url)
        for method, path, body, param in REFUSED:
            r = raw(op, method, path, body)
            err = error(r, 400)
            assert err["param"] == param, (body[:80], err)
            assert err["type"] == "invalid_request_error"
        assert redis_dump(redis_server.url) == dump  # nothing was stored
        assert op("GET", "/acme").json() == before
        error(op("GET", "/x"), 404)
        for replica_ in (a, b):  # and every replica still lists and serves
            listed = Admin(replica_)("GET")
            assert listed.status_code == 200 and [t["id"] for t in listed.json()["data"]] \
                == ["acme", "one"]
            assert chat(replica_, TEST_KEY) == 200
        # the bounds themselves are accepted
        ok = {"weight": 1e6, "quotas": {"tokens_per_minute": 10**15, "max_queued": 10**6},
              "priority": {"min": -(10**6), "max": 10**6, "default": 0},
              "name": "Café ☕ 👩‍💻" + "n" * 245, "models": ["*", "m", "org/model-7b:v1"]}
        r = op("PATCH", "/acme", ok)
        assert r.status_code == 200, r.text
        assert op("GET", "/acme").json() == r.json()


def plant(url: str, tenants: dict[str, str], keys: dict[str, str]) -> None:
    """Write records into Redis as an older version (or a hand) did: past every check."""
    with redis.Redis.from_url(url) as r:
        prefix = "sluice:{registry:tenants}"
        if tenants:
            r.hset(f"{prefix}:records", mapping=tenants)
        if keys:
            r.hset(f"{prefix}:keys", mapping=keys)
        r.incr(f"{prefix}:version")  # every replica reloads


def old(record: dict[str, Any]) -> str:
    """What the older version stored: Python's JSON, Infinity and surrogates allowed."""
    return canonical(record, strict=False)


def test_bad_records_in_redis_are_skipped_never_a_500(
        shared: GatewayConfig, redis_server: RedisServer,
        caplog: pytest.LogCaptureFixture) -> None:
    with replica(shared) as a, replica(shared) as b:
        op_a, op_b = Admin(a), Admin(b)
        assert op_a("POST", "", {"id": "good"}).status_code == 201
        key = op_a("POST", "/good/keys").json()["key"]
        plant(redis_server.url, {
            "poisoned": old({"id": "poisoned", "weight": float("inf")}),
            "surrogate": old({"id": "surrogate", "models": ["\udc80"]}),
            "huge": old({"id": "huge", "quotas": {"tokens_per_minute": 10**400}}),
            "elsewhere": old({"id": "other-id"}),
            "broken": "{not json",
            "deep": "[" * 100_000 + "]" * 100_000,
        }, {
            "key_0000000000000000": "{not json",
            "key_1111111111111111": json.dumps({"id": "key_1111111111111111",
                                                "tenant": "good", "role": "user",
                                                "digest": "sha256:" + "0" * 64,
                                                "created": 1e999}),
        })
        with redis.Redis.from_url(redis_server.url) as r:
            version = int(r.get("sluice:{registry:tenants}:version") or 0)
        for gw in (a, b):  # both replicas have reloaded the records planted
            within(PROPAGATION_S, lambda gw=gw: gw.gateway.registry.version == version)
        for admin, gw in ((op_a, a), (op_b, b)):
            listed = admin("GET")
            assert listed.status_code == 200, listed.text
            assert [t["id"] for t in listed.json()["data"]] == ["good", "one"]
            assert chat(gw, key) == 200 and chat(gw, TEST_KEY) == 200  # the registry serves
            assert {"good", "one"} <= set(gw.gateway.registry.tenants)
            assert not {"poisoned", "surrogate", "huge", "elsewhere"} \
                & set(gw.gateway.registry.tenants)
            keys = admin("GET", "/good/keys")
            assert keys.status_code == 200 and len(keys.json()["data"]) == 1
        for tid, named in [("poisoned", "weight"), ("surrogate", "models[0]"),
                           ("huge", "quotas.tokens_per_minute"), ("elsewhere", "other-id"),
                           ("broken", "cannot be read"), ("deep", "cannot be read")]:
            err = error(op_b("GET", f"/{tid}"), 409, "tenant")
            assert err["code"] == "invalid_record" and named in err["message"], err
            assert ("PATCH" in err["message"]) == (named not in ("other-id",
                                                                 "cannot be read"))
        assert "left out" in caplog.text

        # an operator repairs or removes them; the replicas follow
        fixed = op_a("PATCH", "/poisoned", {"weight": 2})
        assert fixed.status_code == 200 and fixed.json()["weight"] == 2.0, fixed.text
        error(op_a("PATCH", "/surrogate", {"name": "still bad models"}), 400, "models[0]")
        assert op_a("PATCH", "/surrogate", {"models": None}).json()["models"] == ["*"]
        for tid in ("huge", "elsewhere", "broken", "deep"):
            assert op_b("DELETE", f"/{tid}").status_code == 200, tid
        within(PROPAGATION_S, lambda: [t["id"] for t in op_b("GET").json()["data"]]
               == ["good", "one", "poisoned", "surrogate"])
        with redis.Redis.from_url(redis_server.url) as r:
            records = r.hgetall("sluice:{registry:tenants}:records")
        assert len(records) == 4 and not any(b"Infinity" in v for v in records.values())
        # deleting the tenant deletes its keys, unreadable ones that name it included
        assert op_a("DELETE", "/good").status_code == 200
        assert "Infinity" not in redis_dump(redis_server.url)


def test_a_hand_written_record_cannot_be_patched_but_can_be_deleted(
        shared: GatewayConfig, redis_server: RedisServer) -> None:
    with replica(shared) as a:
        op = Admin(a)
        plant(redis_server.url, {"hand": '{ "id": "hand", "weight": 1e999 }'}, {})
        err = error(op("PATCH", "/hand", {"weight": 1}), 409, "tenant")
        assert err["code"] == "invalid_record" and "DELETE" in err["message"]
        assert op("DELETE", "/hand").status_code == 200
        error(op("GET", "/hand"), 404)


def test_the_tenants_file_is_held_to_the_same_rules() -> None:
    from gateway.config import TenantEntry

    for bad in ({"id": "a", "weight": float("inf")}, {"id": "a", "name": "\udc80"},
                {"id": "a\n"}, {"id": "a", "quotas": {"tokens_per_minute": 10**16}},
                {"id": "a", "keys": ["sha256:" + "0" * 64 + "\n"]}):
        with pytest.raises(ValueError):
            TenantEntry.model_validate(bad)


def test_a_memory_store_gateway_refuses_the_same(fake_gw: ThreadedGateway) -> None:
    op = Admin(fake_gw)
    assert op("POST", "", {"id": "acme"}).status_code == 201
    for method, path, body, param in REFUSED:
        assert error(raw(op, method, path, body), 400)["param"] == param
    listed = op("GET")
    assert listed.status_code == 200 and len(listed.json()["data"]) == 2


@pytest.fixture
def fake_gw() -> Iterator[ThreadedGateway]:
    from .test_admin import file_tenants

    with FakeBackend() as fake, ThreadedGateway(config_for(fake.url), file_tenants()) as g:
        yield g
