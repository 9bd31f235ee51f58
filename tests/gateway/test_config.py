"""gateway.yaml and tenants.yaml: the shipped examples load, mistakes are named clearly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import DEMO_KEYS, demo_tenants
from gateway.config import load_gateway_config, load_tenants
from gateway.errors import ConfigError
from gateway.tenants import KeyRing

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_the_shipped_configs_load_and_match_the_demo_tenants() -> None:
    cfg = load_gateway_config(CONFIGS / "gateway.yaml", env={})
    assert cfg.listen.host == "127.0.0.1"  # the default bind is local only
    assert [m.name for m in cfg.models] == ["sluice-tiny"]
    assert cfg.tenants_file == (CONFIGS / "tenants.yaml").resolve()
    tenants = load_tenants(cfg.tenants_file)
    assert tenants == demo_tenants()
    ring = KeyRing(tenants)
    for tenant_id, key in DEMO_KEYS.items():
        found = ring.lookup(key.encode())
        assert found is not None and found.id == tenant_id
    assert "sk-demo" not in (CONFIGS / "tenants.yaml").read_text().split("#")[0]


def test_environment_overrides(tmp_path: Path) -> None:
    cfg = load_gateway_config(CONFIGS / "gateway.yaml", env={
        "SLUICE_LISTEN__PORT": "9123", "SLUICE_TIMEOUTS__READ_S": "12.5",
        "SLUICE_TENANTS_FILE": str(tmp_path / "t.yaml"), "OTHER": "x"})
    assert cfg.listen.port == 9123 and cfg.timeouts.read_s == 12.5
    assert cfg.tenants_file == tmp_path / "t.yaml"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(("text", "needle"), [
    ("models: []", "models"),
    ("models: [{name: a, upstream: 'ftp://x'}]", "models.0.upstream"),
    ("models: [{name: a@b, upstream: 'http://x'}]", "models.0.name"),
    ("models: [{name: a, upstream: 'http://x', supports: [teleport]}]", "teleport"),
    ("models: [{name: a, upstream: 'http://x'}, {name: a, upstream: 'http://y'}]", "unique"),
    ("models: [{name: a, upstream: 'http://x', tokenizer: magic}]", "tokenizer"),
    ("models: [{name: a, upstream: 'http://x'}]\nlisten: {port: 99999}", "listen.port"),
    ("models: [{name: a, upstream: 'http://x'}]\nunknown_key: 1", "unknown_key"),
    ("models: [{name: a, upstream: 'http://x'}]\nqueue: {reserve_share: 1}",
     "queue.reserve_share"),
    (("models: [{name: a, upstream: 'http://x'}]\nresilience: {breaker: {ramp_s: 1, "
      "ramp_start_rps: 2}}"), "resilience.breaker"),  # a ramp step of 0.2 requests
    ("- just a list", "mapping"),
    ("models: [", "not valid YAML"),
])
def test_gateway_config_errors_name_the_field(tmp_path: Path, text: str, needle: str) -> None:
    path = write(tmp_path, "g.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_gateway_config(path, env={})
    assert needle in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize(("text", "needle"), [
    ("tenants: [{id: 'bad id'}]", "tenants.0.id"),
    ("tenants: [{id: a, keys: [sk-plain]}]", "sha256"),
    ("tenants: [{id: a}, {id: a}]", "unique"),
    ("tenants: [{id: a, priority: {min: 5, max: 1, default: 3}}]", "priority"),
    ("tenants: [{id: a, caps: {on_exceed: ignore}}]", "on_exceed"),
    (f"tenants: [{{id: a, keys: ['sha256:{'0' * 64}']}}, {{id: b, keys: ['sha256:{'0' * 64}']}}]",
     "one key"),
])
def test_tenant_errors_name_the_field(tmp_path: Path, text: str, needle: str) -> None:
    path = write(tmp_path, "t.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_tenants(path)
    assert needle in str(info.value)


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read .*nope.yaml"):
        load_gateway_config(tmp_path / "nope.yaml", env={})


def test_the_gateway_command_refuses_a_bad_config(tmp_path: Path) -> None:
    path = write(tmp_path, "g.yaml", "models: []")
    proc = subprocess.run([sys.executable, "-m", "sluice.cli", "gateway", "--config", str(path)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "models" in proc.stderr


def test_hash_key_command() -> None:
    proc = subprocess.run([sys.executable, "-m", "sluice.cli", "hash-key", "sk-demo-beta"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.stdout.strip() == ("sha256:577fa7d4312b173a1af7c3f154de007bfecfde4e48ac3f92d8"
                                   "ccbeb57feacd71")


def test_the_queue_reserve_reaches_every_upstreams_queue(tmp_path: Path) -> None:
    from gateway.service import build_gateway

    path = write(tmp_path, "g.yaml", "models: [{name: a, upstreams: ['http://127.0.0.1:1', "
                 "'http://127.0.0.1:2']}]\nqueue: {reserve_share: 0.25, reserve_priority: 2}")
    cfg = load_gateway_config(path, env={})
    gw = build_gateway(cfg, demo_tenants())
    assert len(gw.queues) == 2
    for q in gw.queues.values():
        assert (q.reserve.share, q.reserve.priority) == (0.25, 2)
        assert q.reserve.urgent(2) and not q.reserve.urgent(3)


def test_the_breaker_ramp_settings_reach_every_member(tmp_path: Path) -> None:
    from gateway.service import build_gateway

    path = write(tmp_path, "g.yaml", "models: [{name: a, upstreams: ['http://127.0.0.1:1', "
                 "'http://127.0.0.1:2']}]\nresilience: {breaker: {ramp_s: 0}}")
    gw = build_gateway(load_gateway_config(path, env={}), demo_tenants())
    members = gw.upstreams["a"].members
    assert len(members) == 2
    assert all(m.breaker.policy.ramp_s == 0 for m in members)
    path.write_text("models: [{name: a, upstream: 'http://127.0.0.1:1'}]\n"
                    "resilience: {breaker: {ramp_s: 20, ramp_start_rps: 0.5}}")
    [m] = build_gateway(load_gateway_config(path, env={}), demo_tenants()).upstreams["a"].members
    assert (m.breaker.policy.ramp_s, m.breaker.policy.ramp_start_rps) == (20, 0.5)


@pytest.mark.parametrize("url", ["redis://h:7000/0?ssl_cert_reqs=none", "rediss://h:7000/?a=b",
                                 "redis://h:7000"])
def test_a_cluster_url_may_carry_options(url: str) -> None:
    cfg = load_gateway_config(CONFIGS / "gateway.yaml", env={
        "SLUICE_REDIS_URL": url, "SLUICE_REDIS_CLUSTER": "1"})
    assert cfg.store.cluster and cfg.store.url == url


@pytest.mark.parametrize(("value", "cluster"), [("1", True), ("yes", True), ("0", False),
                                                ("", False), ("off", False)])
def test_sluice_redis_cluster_turns_cluster_mode_on(value: str, cluster: bool) -> None:
    cfg = load_gateway_config(CONFIGS / "gateway.yaml", env={
        "SLUICE_REDIS_URL": "redis://10.0.0.7:7000", "SLUICE_REDIS_CLUSTER": value})
    assert cfg.store.cluster is cluster and cfg.store.url == "redis://10.0.0.7:7000"


@pytest.mark.parametrize(("env", "message"), [
    ({"SLUICE_REDIS_CLUSTER": "1"}, "store.cluster needs store.url"),
    ({"SLUICE_REDIS_CLUSTER": "1", "SLUICE_REDIS_URL": "redis://h:7000/3"}, "database 0 only"),
    ({"SLUICE_REDIS_CLUSTER": "maybe", "SLUICE_REDIS_URL": "redis://h:7000"}, "store.cluster"),
])
def test_a_bad_cluster_setting_is_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_gateway_config(CONFIGS / "gateway.yaml", env=env)


def test_sluice_up_redis_cluster_flag_sets_cluster_mode(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from gateway.cli import up_config
    from gateway.config import ModelEntry

    for name in ("SLUICE_REDIS_URL", "SLUICE_REDIS_CLUSTER"):
        monkeypatch.delenv(name, raising=False)
    entry = ModelEntry(name="m", upstream="http://127.0.0.1:1")
    args = argparse.Namespace(host="127.0.0.1", port=8000, tenants=None,
                              redis="redis://127.0.0.1:7000/0", redis_cluster=True)
    cfg = up_config(args, entry)
    assert cfg.store.cluster and cfg.store.url == "redis://127.0.0.1:7000/0"
    args.redis_cluster = False
    assert not up_config(args, entry).store.cluster
    args.redis, args.redis_cluster = None, True
    with pytest.raises(ConfigError, match="store.cluster needs store.url"):
        up_config(args, entry)
