"""docker/: the compose file, the Dockerfile and .dockerignore keep their contract.

There is no Docker engine here, so images are not built. `docker-compose config` (compose
v1 from apt) validates the compose file offline; CI installs it and sets
SLUICE_REQUIRE_COMPOSE=1, which turns a missing binary into a failure instead of a skip.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import load_gateway_config

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
COMPOSE = DOCKER / "compose.yaml"
SERVICES = {"redis", "backend", "gateway", "nginx", "otel-collector", "jaeger", "prometheus",
            "vllm", "redis-cluster-init", "gateway-cluster",
            *(f"redis-c{i}" for i in range(1, 7))}


def compose_bin() -> str:
    binary = shutil.which("docker-compose")
    if binary is None:
        if os.environ.get("SLUICE_REQUIRE_COMPOSE") == "1":
            pytest.fail("docker-compose is required here (SLUICE_REQUIRE_COMPOSE=1): "
                        "apt-get install -y --no-install-recommends docker-compose")
        pytest.skip("docker-compose is not installed (CI installs it)")
    return binary


def compose(*args: str) -> subprocess.CompletedProcess[str]:
    # Only this test's variables: the stack's defaults are what gets checked.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLUICE_", "VLLM_", "OTEL_", "COMPOSE_", "HF_"))}
    return subprocess.run([compose_bin(), "-f", str(COMPOSE), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("extra", [[], ["--profile", "vllm"], ["--profile", "cluster"],
                                   ["-f", str(DOCKER / "compose.ui.yaml")]])
def test_docker_compose_validates_the_file(extra: list[str]) -> None:
    proc = compose(*extra, "config", "-q")
    assert proc.returncode == 0, proc.stderr


def test_resolved_stack_publishes_only_the_balancer_on_loopback() -> None:
    proc = compose("--profile", "vllm", "config")
    assert proc.returncode == 0, proc.stderr
    services = yaml.safe_load(proc.stdout)["services"]
    assert set(services) == SERVICES
    published = {name: s["ports"] for name, s in services.items() if s.get("ports")}
    assert list(published) == ["nginx"]
    (port,) = published["nginx"]
    host_ip = port.get("host_ip") if isinstance(port, dict) else str(port).split(":")[0]
    assert host_ip == "127.0.0.1", port


def raw_compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def test_gateways_scale_out_behind_nginx_on_shared_redis() -> None:
    services = raw_compose()["services"]
    gateway = services["gateway"]
    assert gateway["deploy"]["replicas"] >= 2
    assert gateway["environment"]["SLUICE_REDIS_URL"] == "redis://redis:6379/0"
    assert gateway["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "healthcheck" in services["redis"]
    assert "maxmemory-policy noeviction" in (DOCKER / "redis.conf").read_text()
    nginx = (DOCKER / "nginx.conf").read_text()
    assert re.search(r"upstream sluice_gateways \{[^}]*server gateway:8000 resolve", nginx)
    assert "include /etc/nginx/sluice-proxy.conf;" in nginx
    mounts = services["nginx"]["volumes"]
    assert "./nginx-proxy.conf:/etc/nginx/sluice-proxy.conf:ro" in mounts
    for path in ("./config/gateway.yaml", "./config/gateway.vllm.yaml"):
        config = load_gateway_config(DOCKER / path, env={})
        assert config.store.url == "redis://redis:6379/0" and config.store.replicas >= 2


def test_tracing_goes_to_jaeger_through_the_collector() -> None:
    services = raw_compose()["services"]
    for name in ("gateway", "backend"):
        env = services[name]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318"
    mount = services["otel-collector"]["volumes"][0]
    collector = yaml.safe_load((DOCKER / mount.split(":")[0]).read_text())
    assert collector["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"
    scraped = (DOCKER / "prometheus.yml").read_text()
    assert all(f"names: [{s}]" in scraped for s in ("gateway", "backend", "vllm"))


def test_the_cluster_profile_runs_six_nodes_and_gateways_in_cluster_mode() -> None:
    proc = compose("--profile", "cluster", "config")
    assert proc.returncode == 0, proc.stderr
    services = yaml.safe_load(proc.stdout)["services"]
    nodes = {f"redis-c{i}" for i in range(1, 7)}
    assert nodes | {"redis-cluster-init", "gateway-cluster"} <= set(services)
    for name in nodes:
        command = " ".join(services[name]["command"])
        assert "--cluster-enabled yes" in command
        assert "--cluster-require-full-coverage no" in command  # one failed master stops
        assert "healthcheck" in services[name]                   # only its own slots
    init = services["redis-cluster-init"]
    assert set(init["depends_on"]) == nodes
    assert "--cluster-replicas 1" in init["command"][0]
    gw = services["gateway-cluster"]
    assert gw["depends_on"]["redis-cluster-init"]["condition"] \
        == "service_completed_successfully"
    assert "gateway" in gw["networks"]["default"]["aliases"]  # what nginx resolves
    env = {k: str(v) for k, v in gw["environment"].items()}
    config = load_gateway_config(DOCKER / "config" / "gateway.yaml", env=env)
    assert config.store.cluster and config.store.url == "redis://redis-c1:6379"


def test_the_vllm_profile_passes_priority_and_cache_salt() -> None:
    vllm = raw_compose()["services"]["vllm"]
    assert vllm["profiles"] == ["vllm"]
    assert vllm["image"].startswith("vllm/vllm-openai:v")
    command = " ".join(vllm["command"])
    assert "--scheduling-policy priority" in command  # vLLM refuses `priority` otherwise
    assert "--served-model-name sluice-vllm" in command
    config = load_gateway_config(DOCKER / "config" / "gateway.vllm.yaml", env={})
    (model,) = config.models
    assert model.name == "sluice-vllm" and model.upstream == "http://vllm:8000"
    assert {"priority", "cache_salt"} <= model.capabilities


def stages(dockerfile: str) -> dict[str, str]:
    """Stage name -> its text (FROM line included)."""
    out: dict[str, str] = {}
    for part in re.split(r"(?m)^(?=FROM )", dockerfile):
        match = re.match(r"FROM \S+ AS (\S+)", part)
        if match:
            out[match.group(1)] = part
    return out


def test_dockerfile_targets_run_unprivileged_with_healthchecks() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"(?m)^ARG PYTHON_IMAGE=python:3\.11\.\d+-slim-\w+$", text)  # pinned
    assert re.search(r"(?m)^ARG TORCH_VARIANT=cpu$", text)  # CPU unless a CUDA index is asked
    by_name = stages(text)
    for target, port in (("gateway", 8000), ("backend", 8001)):
        stage = by_name[target]
        user = re.search(r"(?m)^USER (\d+)(?::(\d+))?$", stage)
        assert user and int(user.group(1)) != 0, target
        assert "HEALTHCHECK" in stage and f"127.0.0.1:{port}/" in stage, target
    assert "torch" not in by_name["deps-gateway"].split("RUN", 1)[1].replace(
        "startswith('torch')", "")  # the gateway image installs everything but torch
    for line in re.findall(r"(?m)^(?:ENV|ARG)\s+.*$", text):  # no secret in a layer
        assert not re.search(r"KEY|TOKEN|SECRET|PASSWORD", line, re.IGNORECASE), line


def test_the_image_sources_hold_every_package() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    source = stages((DOCKER / "Dockerfile").read_text())["source"]
    for pattern in include:  # "gateway*": the package and its subpackages
        package = pattern.rstrip("*")
        assert f"COPY {package} /src/{package}\n" in source, package


def test_dockerignore_keeps_caches_and_venv_out() -> None:
    ignored = set((REPO / ".dockerignore").read_text().split())
    assert {".git", ".venv", "**/__pycache__", ".pytest_cache", "docker/models"} <= ignored


def test_the_backend_is_keyed_and_every_caller_has_the_key() -> None:
    services = raw_compose()["services"]
    key = "${SLUICE_BACKEND_API_KEY:-}"  # no default: the operator sets it
    assert services["backend"]["environment"]["SLUICE_BACKEND_API_KEY"] == key
    gateway = services["gateway"]["environment"]
    assert gateway["SLUICE_BACKEND_API_KEY"] == key
    assert gateway["SLUICE_CACHE_SALT_KEY"] == "${SLUICE_CACHE_SALT_KEY:-}"  # one for all
    (model,) = load_gateway_config(DOCKER / "config" / "gateway.yaml", env={}).models
    assert model.api_key_env == "SLUICE_BACKEND_API_KEY"
    # Prometheus scrapes the backend's /metrics with it, from the file its entrypoint writes
    prometheus = services["prometheus"]
    assert prometheus["environment"]["SLUICE_BACKEND_API_KEY"] == key
    jobs = {j["job_name"]: j for j in yaml.safe_load(
        (DOCKER / "prometheus.yml").read_text())["scrape_configs"]}
    auth = jobs["sluice-backend"]["authorization"]
    assert auth["type"] == "Bearer"
    assert auth["credentials_file"] in " ".join(prometheus["entrypoint"])
    assert "exec /bin/prometheus" in " ".join(prometheus["entrypoint"])
