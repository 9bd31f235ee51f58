"""The tenants' cache_salt: an HMAC under the gateway's key, never computable from the
tenant id alone; where the key comes from, and when the gateway refuses to start without it."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.cache_salt import SALT_KEY_ENV, CacheSalter, salter_from_env
from gateway.config import GatewayConfig, ModelEntry, StoreConfig
from gateway.errors import ConfigError

from .conftest import ThreadedGateway, auth, config_for, tenants_for_tests
from .fake_backend import FakeBackend

KEY_A = "a" * 16 + "-salt-key-for-tests-0123456789"
KEY_B = "b" * 16 + "-salt-key-for-tests-0123456789"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


def unkeyed(tenant_id: str) -> str:
    """The salt before the gateway held a key: anyone could compute it."""
    return hashlib.sha256(b"sluice/cache-salt/v1\0" + tenant_id.encode()).hexdigest()[:32]


def test_the_salt_is_an_hmac_of_the_tenant_under_the_key() -> None:
    a, b = CacheSalter(KEY_A.encode()), CacheSalter(KEY_B.encode())
    salt = a.salt("one")
    assert len(salt) == 32 and int(salt, 16) >= 0  # the shape the backend takes
    assert salt == a.salt("one") != a.salt("two")  # stable, and one per tenant
    assert salt != b.salt("one")  # another key, another salt: rotation changes them all
    assert salt != unkeyed("one")  # the tenant id alone no longer gives it
    want = hmac.new(KEY_A.encode(), b"sluice/cache-salt/v2\0one", hashlib.sha256)
    assert salt == want.hexdigest()[:32]
    assert KEY_A not in repr(a)
    assert CacheSalter.for_process().salt("one") != CacheSalter.for_process().salt("one")


def config(replicas: int = 1, kind: str = "sluice") -> GatewayConfig:
    return GatewayConfig(models=[ModelEntry(name="m", upstream="http://127.0.0.1:1",
                                            kind=kind)],  # type: ignore[arg-type]
                         store=StoreConfig(url="redis://127.0.0.1:1/0", replicas=replicas))


def test_the_key_comes_from_the_environment(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "sluice.gateway.cache_salt"):
        s = salter_from_env(config(replicas=3), {SALT_KEY_ENV: KEY_A})
        assert s.shared and s.salt("one") == CacheSalter(KEY_A.encode()).salt("one")
        with pytest.raises(ConfigError, match="at least 32"):
            salter_from_env(config(), {SALT_KEY_ENV: "short"})
    assert not caplog.records


def test_without_a_key_one_replica_warns_and_several_refuse(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "sluice.gateway.cache_salt"):
        alone = salter_from_env(config(replicas=1), {})
    assert not alone.shared
    assert SALT_KEY_ENV in caplog.text and "cache hits" in caplog.text
    with pytest.raises(ConfigError, match=f"{SALT_KEY_ENV} is not set"):
        salter_from_env(config(replicas=2), {})
    caplog.clear()
    with caplog.at_level(logging.WARNING, "sluice.gateway.cache_salt"):
        # no model gets a cache_salt: the key is unused, nothing to warn about or refuse
        assert not salter_from_env(config(replicas=2, kind="openai"), {}).shared
    assert not caplog.records


def test_sluice_gateway_refuses_several_replicas_without_the_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from sluice.cli import main

    (tmp_path / "tenants.yaml").write_text(json.dumps({"tenants": []}))
    path = tmp_path / "gateway.yaml"
    path.write_text(json.dumps({
        "tenants_file": "tenants.yaml", "store": {"url": "redis://127.0.0.1:1/0", "replicas": 2},
        "models": [{"name": "m", "upstream": "http://127.0.0.1:1", "kind": "sluice"}]}))
    monkeypatch.delenv(SALT_KEY_ENV, raising=False)
    assert main(["gateway", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "cannot start" in err and SALT_KEY_ENV in err


@pytest.fixture
def fake() -> Iterator[FakeBackend]:
    with FakeBackend() as f:
        yield f


def salt_sent(fake: FakeBackend) -> str:
    import httpx

    with ThreadedGateway(config_for(fake.url), tenants_for_tests()) as gw:
        r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=auth(), timeout=30)
        assert r.status_code == 200, r.text
    return str(fake.bodies[-1]["cache_salt"])


def test_the_gateway_sends_the_keyed_salt(fake: FakeBackend,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SALT_KEY_ENV, KEY_A)
    first = salt_sent(fake)
    assert first == CacheSalter(KEY_A.encode()).salt("one")  # tenant "one" of the tests
    assert first != unkeyed("one")
    assert salt_sent(fake) == first  # a restarted replica, or another one: the same salt
    monkeypatch.setenv(SALT_KEY_ENV, KEY_B)  # rotated: every salt changes
    assert salt_sent(fake) not in (first, unkeyed("one"))


def test_an_unset_key_gives_each_process_its_own_salt(
        fake: FakeBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SALT_KEY_ENV, raising=False)
    assert salt_sent(fake) != salt_sent(fake) != unkeyed("one")
