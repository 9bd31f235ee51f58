"""The overhead bench's generated configs and Redis/metrics readings (no server runs here)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import yaml

from gateway.config import load_gateway_config, load_tenants
from loadtest import overhead
from loadtest import targets as procs
from loadtest.measure import CHAT_BODY, LADDER


def _write(tmp_path: Path, redis_url: str | None) -> Path:
    return procs.write_gateway_config(tmp_path, 8001, 8002, redis_url)


def test_memory_mode_gateway_config_has_no_store_and_no_quotas(tmp_path: Path) -> None:
    cfg = load_gateway_config(_write(tmp_path, None), env={})
    assert cfg.store.url is None
    assert cfg.listen.port == 8001
    assert [m.upstream for m in cfg.models] == ["http://127.0.0.1:8002"]
    assert cfg.models[0].capacity.kv_tokens is None and cfg.models[0].capacity.max_seqs is None
    (tenant,) = load_tenants(tmp_path / "tenants.yaml").tenants
    assert tenant.id == "bench"
    assert tenant.quotas.model_dump() == {k: None for k in tenant.quotas.model_dump()}


def test_redis_mode_puts_admission_in_redis_with_quotas_that_are_on(tmp_path: Path) -> None:
    cfg = load_gateway_config(_write(tmp_path, "redis://127.0.0.1:6390/0"), env={})
    assert cfg.store.url == "redis://127.0.0.1:6390/0"
    assert cfg.store.timeout_s == procs.REDIS_TIMEOUT_S == 0.25
    # a known capacity: every request takes a slot of the gate in Redis
    assert cfg.models[0].capacity.model_dump() == procs.BENCH_CAPACITY
    (tenant,) = load_tenants(tmp_path / "tenants.yaml").tenants
    quotas = tenant.quotas.model_dump(exclude_none=True)
    assert quotas == procs.BENCH_QUOTAS
    assert tenant.fail_mode == "closed"  # a Redis failure shows up as errors, not as a bypass


def test_bench_quotas_and_capacity_never_bind_even_at_the_top_of_the_ladder() -> None:
    # worst case reserved per request: prompt (bytes tokenizer: at most the body) + max_tokens
    worst = len(CHAT_BODY) + 20
    per_minute = LADDER[-1] * 60
    q = procs.BENCH_QUOTAS
    assert q["requests_per_minute"] >= 10 * per_minute
    assert q["tokens_per_minute"] >= 10 * per_minute * worst
    assert q["tokens_per_day"] >= 10 * 60 * per_minute * worst  # ten hours of it
    assert q["max_concurrency"] >= LADDER[-1] * 10  # 10 s of requests in flight
    cap = procs.BENCH_CAPACITY
    assert cap["max_seqs"] >= LADDER[-1] * 10
    assert cap["kv_tokens"] >= LADDER[-1] * 10 * worst
    # Lua numbers are doubles: bucket levels in micro-units must stay exact
    assert q["tokens_per_minute"] * 1_000_000 < 2**53


def test_gateway_env_overrides_are_left_out() -> None:
    env = {"SLUICE_REDIS_URL": "redis://x", "SLUICE_STORE__URL": "redis://y", "PATH": "/bin",
           "MY_SLUICE_X": "1"}
    assert set(procs.gateway_env_unset(env)) == {"SLUICE_REDIS_URL", "SLUICE_STORE__URL"}


def test_litellm_config_without_redis_is_the_plain_baseline() -> None:
    cfg = yaml.safe_load(procs.litellm_yaml(9000))
    assert "router_settings" not in cfg
    (model,) = cfg["model_list"]
    assert model["litellm_params"] == {"model": "openai/fake",
                                       "api_base": "http://127.0.0.1:9000/v1",
                                       "api_key": "sk-upstream-unused"}


def test_litellm_config_with_redis_tracks_tpm_rpm_there() -> None:
    cfg = yaml.safe_load(procs.litellm_yaml(9000, 6390))
    assert cfg["router_settings"] == {"routing_strategy": "usage-based-routing-v2",
                                      "redis_host": "127.0.0.1", "redis_port": 6390}
    params = cfg["model_list"][0]["litellm_params"]
    assert params["tpm"] == procs.LITELLM_TPM and params["rpm"] == procs.LITELLM_RPM
    assert params["rpm"] >= procs.BENCH_QUOTAS["requests_per_minute"]
    assert cfg["general_settings"]["master_key"] == procs.BENCH_KEY


def test_redis_argv_has_no_persistence(tmp_path: Path) -> None:
    argv = procs.redis_argv("redis-server", 6390, tmp_path)
    assert argv[argv.index("--save") + 1] == ""
    assert argv[argv.index("--appendonly") + 1] == "no"
    assert argv[argv.index("--bind") + 1] == "127.0.0.1"


def test_command_stats_and_delta_leave_the_probe_out() -> None:
    before = procs.command_stats({"cmdstat_evalsha": {"calls": 10, "usec": 1000},
                                  "cmdstat_info": {"calls": 3, "usec": 30},
                                  "redis_version": "7.0.15"})
    assert before == {"evalsha": (10, 1000), "info": (3, 30)}
    after = {"evalsha": (50, 5000), "info": (5, 50), "get": (4, 8), "mget": (0, 0)}
    assert procs.command_delta(before, after) == {"evalsha": (40, 4000), "get": (4, 8)}


@pytest.mark.parametrize(("key", "pattern"), [
    ("sluice:{bench}:bucket", "sluice:{bench}:bucket"),
    ("sluice:{up:fake}:slots", "sluice:{up:fake}:slots"),
    ("3f9a0c1d2e4b5a6978f0e1d2c3b4a5968778695a4b3c2d1e0f:openai/fake:rpm:09-21",
     "<id>:openai/fake:rpm:<HH-MM>"),
    ("global_router:6c1e7b0a-4a61-4c33-9d2f-0a1b2c3d4e5f:openai/fake:tpm:23-59",
     "global_router:<id>:openai/fake:tpm:<HH-MM>"),
    ("budget:1735689600:spend", "budget:<n>:spend"),
])
def test_key_pattern(key: str, pattern: str) -> None:
    assert procs.key_pattern(key) == pattern


def test_metric_totals_sum_over_labels() -> None:
    text = """\
# HELP sluice_gateway_responses_total Responses sent.
# TYPE sluice_gateway_responses_total counter
sluice_gateway_responses_total{route="/v1/chat/completions",tenant="bench",status="200"} 40
sluice_gateway_responses_total{route="/healthz",tenant="-",status="200"} 2
sluice_gateway_store_errors_total 0
sluice_gateway_leases_live 0
"""
    totals = procs.metric_totals(text)
    assert totals == {"sluice_gateway_responses_total": 42.0,
                      "sluice_gateway_store_errors_total": 0.0,
                      "sluice_gateway_leases_live": 0.0}
    assert procs.metric_lines(text, "sluice_gateway_store_errors_total") == [
        "sluice_gateway_store_errors_total 0"]
    assert len(procs.metric_lines(text, "sluice_gateway_responses_total")) == 2


def test_redis_mode_has_its_own_goals_and_refuses_self_check() -> None:
    assert overhead.GOALS["redis"] == overhead.Goals(2.0, 6.0, 3.0, None)
    assert overhead.GOALS["memory"] == overhead.Goals(1.5, 5.0, 4.0, 0.25)
    with pytest.raises(SystemExit) as exc:
        overhead.main(["--redis", "--self-check"])
    assert exc.value.code == 2


def test_cpu_split_puts_a_childs_cpu_apart_from_its_parents(tmp_path: Path) -> None:
    # the parent idles while its child (same process group) burns ~0.4 s of CPU
    burn = ("import os, subprocess, sys, time\n"
            "c = subprocess.Popen([sys.executable, '-c', "
            "'import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.4: pass'])\n"
            "c.wait()\n"
            "time.sleep(30)\n")
    service = procs._spawn("burn", [sys.executable, "-c", burn], 0, tmp_path)
    try:
        deadline = time.monotonic() + 30
        own, others = service.cpu_split()
        while others < 0.3 and time.monotonic() < deadline:
            # the child is counted while it lives: sample until it has burnt most of it
            time.sleep(0.05)
            own, others = service.cpu_split()
        assert others >= 0.3
        assert own < 0.3
        assert service.cpu_seconds() >= own + 0.3 - 0.02
    finally:
        service.stop()


def test_the_benches_hash_keys_as_the_gateway_does() -> None:
    from gateway.tenants import hash_key

    assert procs.hash_key("sk-bench") == hash_key("sk-bench")
