"""The tenant admin API through real gateways: CRUD, every refusal, tenant-admin scope,
propagation to a second replica through Redis within 1 s, seeding, outages, the CLI."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis

from gateway.config import GatewayConfig, Listen, QuotasConfig, TenantEntry, TenantsFile
from gateway.registry import Registry
from gateway.tenants import hash_key
from gateway.tenants_cli import main as tenants_main
from tests.backend.server.conftest import free_port
from tests.policies.conftest import RedisServer

from .conftest import TEST_KEY, ThreadedGateway, config_for
from .fake_backend import FakeBackend
from .test_admission import with_store

OPERATOR = "sk-operator-for-tests"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
PROPAGATION_S = 1.0


def file_tenants() -> TenantsFile:
    return TenantsFile(tenants=[TenantEntry(id="one", keys=[hash_key(TEST_KEY)],
                                            quotas=QuotasConfig(requests_per_minute=1000))])


class Admin:
    def __init__(self, gw: ThreadedGateway, key: str | None = OPERATOR) -> None:
        self.base = gw.url + "/admin/v1/tenants"
        self.headers = {} if key is None else {"authorization": f"Bearer {key}"}

    def __call__(self, method: str, path: str = "", body: Any = None,
                 content: bytes | None = None) -> httpx.Response:
        return httpx.request(method, self.base + path, json=body, content=content,
                             headers=self.headers, timeout=10)


def chat(gw: ThreadedGateway, key: str) -> int:
    return httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=10,
                      headers={"authorization": f"Bearer {key}"}).status_code


def within(seconds: float, check: Callable[[], bool]) -> float:
    """How long until ``check()`` holds, polling; fails past ``seconds``."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < seconds, f"not within {seconds} s"
        time.sleep(0.02)
    return time.monotonic() - start


def error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "code", "param"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.fixture(autouse=True)
def operator_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_ADMIN_KEY", OPERATOR)


@pytest.fixture
def fake() -> Iterator[FakeBackend]:
    with FakeBackend() as f:
        yield f


@pytest.fixture
def gw(fake: FakeBackend) -> Iterator[ThreadedGateway]:
    with ThreadedGateway(config_for(fake.url), file_tenants()) as g:
        yield g


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis-admin"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def shared(fake: FakeBackend, redis_server: RedisServer) -> GatewayConfig:
    """A config on a freshly emptied Redis; each replica gets its own port."""
    with redis.Redis.from_url(redis_server.url) as r:
        r.flushall()
    return with_store(config_for(fake.url), redis_server.url)


def replica(cfg: GatewayConfig, tenants: TenantsFile | None = None) -> ThreadedGateway:
    return ThreadedGateway(cfg.model_copy(update={"listen": Listen(port=free_port())}),
                           tenants or file_tenants())


# ---- CRUD -------------------------------------------------------------------------------------
def test_tenant_and_key_lifecycle(gw: ThreadedGateway) -> None:
    admin = Admin(gw)
    r = admin("POST", "", {"id": "acme", "name": "Acme", "models": ["m"],
                           "priority": {"default": 3, "min": 1, "max": 6},
                           "quotas": {"requests_per_minute": 100}, "fail_mode": "open"})
    assert r.status_code == 201, r.text
    created = r.json()
    assert created["quotas"] == {"tokens_per_minute": None, "requests_per_minute": 100,
                                 "tokens_per_day": None, "tokens_per_month": None,
                                 "max_concurrency": None, "max_queued": None}
    assert created["priority"] == {"min": 1, "max": 6, "default": 3}
    assert created["fail_mode"] == "open" and "keys" not in created
    assert admin("GET", "/acme").json() == created
    assert [t["id"] for t in admin("GET").json()["data"]] == ["acme", "one"]  # file seeded

    r = admin("PATCH", "/acme", {"quotas": {"tokens_per_day": 5000, "requests_per_minute":
                                            None}, "priority": {"max": 8}})
    assert r.status_code == 200, r.text
    patched = r.json()
    assert patched["quotas"]["tokens_per_day"] == 5000
    assert patched["quotas"]["requests_per_minute"] is None  # null: back to unlimited
    assert patched["priority"] == {"min": 1, "max": 8, "default": 3}  # merged, not replaced
    assert patched["name"] == "Acme" and admin("GET", "/acme").json() == patched
    assert gw.gateway.registry.tenants["acme"].quotas.tokens_per_day == 5000

    r = admin("POST", "/acme/keys", {"role": "user"})
    assert r.status_code == 201 and r.headers["cache-control"] == "no-store"
    key = r.json()
    assert key["key"].startswith("sk-") and len(key["key"]) > 40 and key["role"] == "user"
    assert chat(gw, key["key"]) == 200  # at once, on this replica
    listed = admin("GET", "/acme/keys").json()["data"]
    assert listed == [{"id": key["id"], "role": "user", "created": key["created"]}]
    assert key["key"] not in json.dumps(listed)

    r = admin("DELETE", f"/acme/keys/{key['id']}")
    assert r.json() == {"id": key["id"], "object": "key", "deleted": True}
    assert chat(gw, key["key"]) == 401 and admin("GET", "/acme/keys").json()["data"] == []

    again = admin("POST", "/acme/keys").json()  # no body: a user key
    assert chat(gw, again["key"]) == 200
    assert admin("DELETE", "/acme").json() == {"id": "acme", "object": "tenant",
                                               "deleted": True}
    assert chat(gw, again["key"]) == 401  # its keys went with it
    error(admin("GET", "/acme"), 404, "tenant")
    assert "acme" not in gw.gateway.registry.tenants


def test_usage_is_the_quota_stores(gw: ThreadedGateway) -> None:
    assert chat(gw, TEST_KEY) == 200 and chat(gw, TEST_KEY) == 200
    expected = gw.call(gw.gateway.admission.store.usage("one"))
    usage = Admin(gw)("GET", "/one/usage").json()
    assert usage == {"tenant": "one", **expected}
    assert usage["requests"]["day"] == 2 and usage["settled"]["day"] > 0
    assert usage["concurrency"] == 0 and "rejects" in usage


def test_every_refusal(gw: ThreadedGateway) -> None:
    admin = Admin(gw)
    ok = {"id": "acme"}
    error(admin("POST", "", {"id": "bad id!"}), 400, "id")
    error(admin("POST", "", {**ok, "priority": {"min": 5, "max": 1, "default": 3}}), 400,
          "priority")
    error(admin("POST", "", {**ok, "quotas": {"tokens_per_minute": -1}}), 400,
          "quotas.tokens_per_minute")
    error(admin("POST", "", {**ok, "fail_mode": "sideways"}), 400, "fail_mode")
    error(admin("POST", "", {**ok, "colour": "red"}), 400, "colour")
    error(admin("POST", "", {**ok, "keys": [hash_key("x")]}), 400, "keys")
    assert error(admin("POST", "", content=b"{nope"), 400)["code"] == "invalid_json"
    error(admin("POST", "", [ok]), 400)
    error(admin("POST", "", content=b"x" * 70_000), 413)
    assert admin("POST", "", ok).status_code == 201
    assert error(admin("POST", "", ok), 409, "id")["code"] == "conflict"
    error(admin("PATCH", "/acme", {"id": "other"}), 400, "id")
    error(admin("PATCH", "/acme", {"quotas": {"max_concurrency": "many"}}), 400,
          "quotas.max_concurrency")
    error(admin("POST", "/acme/keys", {"role": "root"}), 400, "role")
    error(admin("POST", "/acme/keys", {"role": "user", "tenant": "x"}), 400, "tenant")
    for method, path in [("GET", "/ghost"), ("PATCH", "/ghost"), ("DELETE", "/ghost"),
                         ("GET", "/ghost/keys"), ("POST", "/ghost/keys"),
                         ("GET", "/ghost/usage"), ("DELETE", "/acme/keys/key_nope")]:
        error(admin(method, path, {} if method in ("PATCH", "POST") else None), 404)
    error(Admin(gw, None)("GET"), 401)
    error(Admin(gw, "sk-wrong")("GET"), 401)
    error(Admin(gw, TEST_KEY)("GET"), 401)  # a user key is no admin key
    error(Admin(gw, OPERATOR)("PUT", "/acme"), 405)
    assert chat(gw, OPERATOR) == 401  # and the operator key is no tenant key


def test_the_admin_api_is_off_without_an_operator_key(
        fake: FakeBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLUICE_ADMIN_KEY")
    with ThreadedGateway(config_for(fake.url), file_tenants()) as g:
        for key in (None, OPERATOR, TEST_KEY):
            err = error(Admin(g, key)("GET"), 404)
            assert "SLUICE_ADMIN_KEY" in err["message"]
        error(Admin(g)("POST", "", {"id": "x"}), 404)
        assert chat(g, TEST_KEY) == 200


def test_a_tenant_admin_manages_its_own_tenant_only(gw: ThreadedGateway) -> None:
    op = Admin(gw)
    for tid in ("a", "b"):
        assert op("POST", "", {"id": tid}).status_code == 201
    ta_key = op("POST", "/a/keys", {"role": "tenant_admin"}).json()
    other_user = op("POST", "/b/keys").json()
    ta = Admin(gw, ta_key["key"])

    assert ta("GET", "/a").json()["id"] == "a"
    assert ta("GET", "/a/usage").status_code == 200
    assert [t["id"] for t in ta("GET").json()["data"]] == ["a"]  # sees its own only
    user = ta("POST", "/a/keys", {"role": "user"})
    assert user.status_code == 201 and chat(gw, user.json()["key"]) == 200
    roles = {k["id"]: k["role"] for k in ta("GET", "/a/keys").json()["data"]}
    assert roles == {ta_key["id"]: "tenant_admin", user.json()["id"]: "user"}
    assert ta("DELETE", f"/a/keys/{user.json()['id']}").status_code == 200

    error(ta("POST", "/a/keys", {"role": "tenant_admin"}), 403, "role")
    error(ta("DELETE", f"/a/keys/{ta_key['id']}"), 403, "key")
    for method, path, body in [
            ("POST", "", {"id": "c"}), ("PATCH", "/a", {"quotas": {"max_concurrency": 1}}),
            ("DELETE", "/a", None),
            ("GET", "/b", None), ("GET", "/b/usage", None), ("GET", "/b/keys", None),
            ("POST", "/b/keys", {"role": "user"}), ("POST", "/b/keys",
                                                    {"role": "tenant_admin"}),
            ("DELETE", f"/b/keys/{other_user['id']}", None), ("PATCH", "/b", {}),
            ("DELETE", "/b", None), ("GET", "/ghost", None)]:
        err = error(ta(method, path, body), 403)
        assert err["code"] == "permission_denied"
    assert op("GET", "/a").json()["quotas"]["max_concurrency"] is None  # unchanged
    assert chat(gw, other_user["key"]) == 200  # untouched
    assert chat(gw, ta_key["key"]) == 401  # not a key for /v1


def test_plaintext_keys_are_never_stored_in_memory(gw: ThreadedGateway) -> None:
    out = Admin(gw)("POST", "/one/keys", {"role": "tenant_admin"}).json()
    kept = repr(vars(gw.gateway.registry.store))  # MemoryTenantStore: every record it holds
    assert out["key"] not in kept and hash_key(out["key"]) in kept


# ---- two replicas on one Redis ----------------------------------------------------------------
def redis_dump(url: str) -> str:
    """Every key and value in Redis, as text."""
    out: list[str] = []
    with redis.Redis.from_url(url, decode_responses=True) as r:
        for k in r.scan_iter("*"):
            kind = r.type(k)
            if kind == "string":
                value: Any = r.get(k)
            elif kind == "hash":
                value = r.hgetall(k)
            elif kind == "set":
                value = r.smembers(k)
            elif kind == "zset":
                value = r.zrange(k, 0, -1, withscores=True)
            else:
                raise AssertionError(f"unexpected {kind} {k}")
            out.append(f"{k} {value}")
    return "\n".join(out)


def test_changes_reach_the_other_replica_within_a_second(
        shared: GatewayConfig, redis_server: RedisServer) -> None:
    with replica(shared) as a, replica(shared) as b:
        op_a, op_b = Admin(a), Admin(b)
        assert op_a("POST", "", {"id": "acme"}).status_code == 201
        assert op_b("GET", "/acme").status_code == 200  # reads come from the store

        key = op_a("POST", "/acme/keys").json()["key"]
        assert chat(a, key) == 200  # at once where it was made
        within(PROPAGATION_S, lambda: chat(b, key) == 200)

        ta = op_b("POST", "/acme/keys", {"role": "tenant_admin"}).json()["key"]
        within(PROPAGATION_S, lambda: Admin(a, ta)("GET", "/acme").status_code == 200)

        dump = redis_dump(redis_server.url)
        assert key not in dump and ta not in dump
        assert hash_key(key) in dump and hash_key(ta) in dump

        # a quota lowered on B applies on A
        assert op_b("PATCH", "/acme", {"quotas": {"requests_per_minute": 0}}).status_code \
            == 200
        within(PROPAGATION_S, lambda: chat(a, key) == 429)

        kid = next(k["id"] for k in op_a("GET", "/acme/keys").json()["data"]
                   if k["role"] == "user")
        assert op_b("DELETE", f"/acme/keys/{kid}").status_code == 200
        assert chat(b, key) == 401  # at once where it was deleted
        within(PROPAGATION_S, lambda: chat(a, key) == 401)

        assert op_a("DELETE", "/acme").status_code == 200
        within(PROPAGATION_S, lambda: Admin(b, ta)("GET", "/acme").status_code == 401)
        within(PROPAGATION_S, lambda: "acme" not in b.gateway.registry.tenants)


def test_the_file_seeds_the_store_and_the_api_wins_afterwards(shared: GatewayConfig) -> None:
    with replica(shared) as a:
        assert isinstance(a.gateway.registry, Registry)
        op = Admin(a)
        assert op("PATCH", "/one", {"name": "changed by the API"}).status_code == 200
        assert op("POST", "", {"id": "gone"}).status_code == 201
        assert op("DELETE", "/gone").status_code == 200
    # a later start whose file says otherwise about "one", lists "gone" again, adds "two"
    later = TenantsFile(tenants=[
        TenantEntry(id="one", name="file name", keys=[hash_key(TEST_KEY)]),
        TenantEntry(id="gone", keys=[hash_key("sk-gone")]),
        TenantEntry(id="two", keys=[hash_key("sk-two")])])
    with replica(shared, later) as b:
        op = Admin(b)
        assert op("GET", "/one").json()["name"] == "changed by the API"
        error(op("GET", "/gone"), 404)
        assert chat(b, "sk-gone") == 401
        assert op("GET", "/two").status_code == 200 and chat(b, "sk-two") == 200
        assert chat(b, TEST_KEY) == 200


def test_a_store_outage_keeps_the_last_records_and_an_empty_store_is_seeded_again(
        fake: FakeBackend, tmp_path: Any) -> None:
    lonely = RedisServer(tmp_path)
    lonely.start()
    try:
        cfg = with_store(config_for(fake.url), lonely.url)
        with ThreadedGateway(cfg, file_tenants()) as g:
            op = Admin(g)
            assert op("POST", "", {"id": "acme"}).status_code == 201
            key = op("POST", "/acme/keys").json()["key"]

            def models(k: str) -> int:  # authenticates without touching the quota store
                return httpx.get(g.url + "/v1/models", timeout=10,
                                 headers={"authorization": f"Bearer {k}"}).status_code

            lonely.stop()
            time.sleep(3 * cfg.admin.poll_interval_s)
            assert models(key) == 200 and models(TEST_KEY) == 200  # last loaded records
            err = error(op("POST", "", {"id": "more"}), 503)
            assert err["code"] == "store_unavailable"
            lonely.start()  # no persistence: empty; the registry seeds the file again
            within(3.0, lambda: models(key) == 401)
            assert models(TEST_KEY) == 200
            assert op("POST", "", {"id": "more"}).status_code == 201
    finally:
        lonely.stop()


# ---- the CLI -----------------------------------------------------------------------------------
def test_the_cli(gw: ThreadedGateway, capsys: pytest.CaptureFixture[str],
                 monkeypatch: pytest.MonkeyPatch) -> None:
    def cli(*argv: str) -> tuple[int, Any, str]:
        code = tenants_main(list(argv))
        out, err = capsys.readouterr()
        return code, json.loads(out) if out.strip() else None, err

    monkeypatch.setenv("SLUICE_URL", gw.url)
    code, out, _ = cli("create", "acme", "--name", "Acme", "--models", "m,other",
                       "--tpm", "1000", "--rpm", "60", "--tpd", "5000", "--tpm-month",
                       "90000", "--max-concurrency", "4", "--max-queued", "8",
                       "--priority-default", "3", "--priority-min", "1",
                       "--priority-max", "6", "--fail-mode", "open")
    assert code == 0
    assert out["models"] == ["m", "other"] and out["fail_mode"] == "open"
    assert out["quotas"] == {"tokens_per_minute": 1000, "requests_per_minute": 60,
                             "tokens_per_day": 5000, "tokens_per_month": 90000,
                             "max_concurrency": 4, "max_queued": 8}
    assert out["priority"] == {"default": 3, "min": 1, "max": 6}
    code, out, _ = cli("update", "acme", "--rpm", "unlimited", "--tpm", "2000")
    assert code == 0 and out["quotas"]["requests_per_minute"] is None
    assert out["quotas"]["tokens_per_minute"] == 2000 and out["quotas"]["tokens_per_day"] == 5000
    assert cli("get", "acme")[1] == out
    assert [t["id"] for t in cli("list")[1]["data"]] == ["acme", "one"]
    code, key, _ = cli("add-key", "acme", "--url", gw.url)  # flags after the action too
    assert code == 0 and key["key"].startswith("sk-") and chat(gw, key["key"]) == 200
    assert cli("keys", "acme")[1]["data"][0]["id"] == key["id"]
    assert cli("usage", "acme")[1]["requests"]["day"] == 1
    assert cli("delete-key", "acme", key["id"])[1]["deleted"] is True
    assert cli("delete", "acme")[1]["deleted"] is True

    code, out, err = cli("get", "acme")
    assert code == 1 and out is None and "404" in err and "no tenant 'acme'" in err
    code, _, err = cli("create", "one")
    assert code == 1 and "409" in err
    code, _, err = cli("--admin-key", "sk-wrong", "list")
    assert code == 1 and "401" in err and "incorrect admin key" in err
    monkeypatch.delenv("SLUICE_ADMIN_KEY")
    code, _, err = cli("list")
    assert code == 2 and "SLUICE_ADMIN_KEY" in err
    code, _, err = cli("list", "--admin-key", OPERATOR, "--url",
                       f"http://127.0.0.1:{free_port()}")
    assert code == 1 and "cannot reach" in err
