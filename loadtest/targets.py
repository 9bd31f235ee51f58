"""The servers the overhead bench measures, each a subprocess on a free 127.0.0.1 port.

Each runs in its own session (process group), so that stopping it by PID also stops any
worker it forked, and so that Ctrl-C reaches the bench alone, which then stops them all.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_KEY = "sk-bench"
MODEL = "fake"


class TargetError(Exception):
    """A server of the bench did not start."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class Service:
    """A running server: its process, its port and where its output goes."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    def cpu_seconds(self) -> float:
        """User + system CPU time of every live process in this service's process group."""
        return sum(self.cpu_split())

    def cpu_split(self) -> tuple[float, float]:
        """CPU seconds of the service's own process, and of the rest of its process group
        (its children: parse-pool workers)."""
        own = others = 0
        tick = os.sysconf("SC_CLK_TCK")
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == self.proc.pid:  # field 5, pgrp
                ticks = int(fields[11]) + int(fields[12])  # utime, stime
                if int(entry.name) == self.proc.pid:
                    own += ticks
                else:
                    others += ticks
        return own / tick, others / tick

    def log_tail(self, n: int = 20) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after 10 s."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        else:  # the leader is gone; its workers may not be
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _spawn(name: str, argv: list[str], port: int, workdir: Path,
           env: dict[str, str] | None = None, unset: tuple[str, ...] = ()) -> Service:
    log = workdir / f"{name}.log"
    full_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    for key in unset:
        full_env.pop(key, None)
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env=full_env)
    return Service(name, proc, port, log)


def wait_ready(service: Service, path: str, timeout: float,
               headers: dict[str, str] | None = None, ok: tuple[int, ...] = (200,)) -> None:
    """Poll GET `path` until a status in `ok`; a dead process or the deadline raises
    TargetError."""
    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{service.port}{path}"
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if service.proc.poll() is not None:
                raise TargetError(f"{service.name} exited with {service.proc.returncode}:\n"
                                  f"{service.log_tail()}")
            try:
                if client.get(url, headers=headers).status_code in ok:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    raise TargetError(f"{service.name} not ready at {url} after {timeout:.0f} s:\n"
                      f"{service.log_tail()}")


def start_redis(workdir: Path) -> Service:
    """`redis-server` without persistence on a free port; ready when it answers PING."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise TargetError("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    service = _spawn("redis", redis_argv(binary, port, workdir), port, workdir)
    try:
        _wait_redis(service, 10)
    except BaseException:
        service.stop()
        raise
    return service


def redis_argv(binary: str, port: int, workdir: Path) -> list[str]:
    return [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(workdir)]


def _wait_redis(service: Service, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if service.proc.poll() is not None:
            raise TargetError(f"redis-server exited with {service.proc.returncode}:\n"
                              f"{service.log_tail()}")
        try:
            with socket.create_connection(("127.0.0.1", service.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise TargetError(f"redis-server not answering on port {service.port} after "
                      f"{timeout:.0f} s:\n{service.log_tail()}")


def start_fake_upstream(workdir: Path, chunks: int) -> Service:
    port = free_port()
    service = _spawn("fake-upstream",
                     [sys.executable, "-m", "sluice.cli", "fake-upstream", "--port", str(port),
                      "--chunks", str(chunks), "--model", MODEL], port, workdir)
    _ready_or_stop(service, "/health", 30)
    return service


# Quotas that are on (every request is reserved against all of them and settled) but never
# bind during the bench: ~2,000 requests/s of ~40 worst-case tokens is ~5 M tokens a minute.
BENCH_QUOTAS = {"tokens_per_minute": 1_000_000_000, "requests_per_minute": 100_000_000,
                "tokens_per_day": 100_000_000_000, "max_concurrency": 100_000}
# The model's capacity in --redis mode: known, so every request takes a slot of the capacity
# gate in Redis (an upstream of unknown capacity skips the gate), and far above the load.
BENCH_CAPACITY = {"kv_tokens": 100_000_000, "max_seqs": 100_000}
# LiteLLM's per-deployment limits, as far above the load as Sluice's.
LITELLM_TPM, LITELLM_RPM = 1_000_000_000, 100_000_000
REDIS_TIMEOUT_S = 0.25


def _flow(mapping: dict[str, int]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in mapping.items()) + "}"


def gateway_yaml(gw_port: int, up_port: int, redis_url: str | None = None) -> str:
    """gateway.yaml; with `redis_url`, quotas and the capacity gate live in that Redis."""
    store = ("" if redis_url is None else
             f"store: {{url: {redis_url}, timeout_s: {REDIS_TIMEOUT_S}}}\n")
    capacity = "" if redis_url is None else f"    capacity: {_flow(BENCH_CAPACITY)}\n"
    return f"""\
listen: {{host: 127.0.0.1, port: {gw_port}}}
{store}tenants_file: tenants.yaml
models:
  - name: {MODEL}
    upstream: http://127.0.0.1:{up_port}
    kind: openai
    versions: {{revision: fake-rev, tokenizer: bytes, chat_template: none, engine: fake-upstream}}
    tokenizer: bytes
{capacity}"""


def hash_key(key: str) -> str:
    """A key as tenants.yaml stores it (what `gateway.tenants.hash_key` computes; loadtest
    reaches the gateway through files and HTTP only)."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def tenants_yaml(quotas: dict[str, int] | None = None) -> str:
    """The bench tenant; with `quotas`, limits that admission enforces on every request."""
    limits = "" if quotas is None else f"    quotas: {_flow(quotas)}\n"
    return f"""\
tenants:
  - id: bench
    name: Benchmark tenant
    keys: ["{hash_key(BENCH_KEY)}"]
    models: ["{MODEL}"]
    priority: {{min: 0, max: 10, default: 5}}
    caps: {{max_prompt_tokens: 100000, max_tokens: 100000, on_exceed: reject}}
{limits}"""


def write_gateway_config(workdir: Path, gw_port: int, up_port: int,
                         redis_url: str | None = None) -> Path:
    (workdir / "tenants.yaml").write_text(
        tenants_yaml(None if redis_url is None else BENCH_QUOTAS))
    config = workdir / "gateway.yaml"
    config.write_text(gateway_yaml(gw_port, up_port, redis_url))
    return config


def gateway_env_unset(environ: dict[str, str] | os._Environ[str]) -> tuple[str, ...]:
    """SLUICE_* variables override gateway.yaml (SLUICE_REDIS_URL sets the store): the bench
    runs the gateway on its own config only."""
    return tuple(k for k in environ if k.startswith("SLUICE_"))


def start_gateway(workdir: Path, up_port: int, redis_url: str | None = None,
                  name: str = "gateway", env: dict[str, str] | None = None) -> Service:
    """`sluice gateway` on its own config; ``env`` adds variables (OTEL_* for tracing)."""
    port = free_port()
    workdir = workdir / name
    workdir.mkdir(exist_ok=True)
    config = write_gateway_config(workdir, port, up_port, redis_url)
    unset = gateway_env_unset(os.environ) + tuple(
        k for k in os.environ if k.startswith("OTEL_") and k not in (env or {}))
    service = _spawn(name, [sys.executable, "-m", "sluice.cli", "gateway", "--config",
                            str(config), "--log-level", "warning"], port, workdir,
                     env=env, unset=unset)
    _ready_or_stop(service, "/healthz", 60)
    return service


# Everything LiteLLM's docs offer to keep a proxy lean, short of code changes: no database
# (so no spend/error logs to write), errors-only logging (which also silences uvicorn's
# access log), the bundled model-cost map instead of a fetch at start, no .env loading.
LITELLM_ENV = {"LITELLM_LOG": "ERROR", "LITELLM_MODE": "PRODUCTION",
               "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
LITELLM_UNSET = ("DATABASE_URL", "DIRECT_URL", "REDIS_HOST", "REDIS_URL")


def litellm_yaml(up_port: int, redis_port: int | None = None) -> str:
    """LiteLLM's config; with `redis_port`, per-deployment tpm/rpm limits tracked in that
    Redis by the router (docs.litellm.ai/docs/proxy/load_balancing: `redis_host` and
    `redis_port` under `router_settings` share tpm/rpm across instances;
    `usage-based-routing-v2` is the strategy that checks them, with redis INCR and MGET)."""
    limits = ("" if redis_port is None else
              f"      tpm: {LITELLM_TPM}\n      rpm: {LITELLM_RPM}\n")
    router = ("" if redis_port is None else f"""\
router_settings:
  routing_strategy: usage-based-routing-v2
  redis_host: 127.0.0.1
  redis_port: {redis_port}
""")
    return f"""\
model_list:
  - model_name: {MODEL}
    litellm_params:
      model: openai/{MODEL}
      api_base: http://127.0.0.1:{up_port}/v1
      api_key: sk-upstream-unused
{limits}general_settings:
  master_key: {BENCH_KEY}
  disable_spend_logs: true
  disable_error_logs: true
litellm_settings:
  set_verbose: false
  json_logs: false
  telemetry: false
  request_timeout: 600
{router}"""


def write_litellm_config(workdir: Path, up_port: int, redis_port: int | None = None) -> Path:
    config = workdir / "litellm.yaml"
    config.write_text(litellm_yaml(up_port, redis_port))
    return config


def litellm_argv(binary: str, config: Path, port: int) -> list[str]:
    return [binary, "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
            "--num_workers", "1"]


def start_litellm(workdir: Path, binary: str, up_port: int,
                  redis_port: int | None = None) -> Service:
    if not Path(binary).exists():
        raise TargetError(f"no LiteLLM at {binary}")
    port = free_port()
    config = write_litellm_config(workdir, up_port, redis_port)
    service = _spawn("litellm", litellm_argv(binary, config, port), port, workdir,
                     LITELLM_ENV, LITELLM_UNSET)
    _ready_or_stop(service, "/health/liveliness", 180)
    return service


def _ready_or_stop(service: Service, path: str, timeout: float) -> None:
    try:
        wait_ready(service, path, timeout)
    except BaseException:
        service.stop()
        raise


# ---- looking inside the bench's Redis and the gateway, between timed windows -------------

CommandStats = dict[str, tuple[int, int]]  # command -> (calls, usec inside Redis)
PROBE_COMMANDS = frozenset({"info", "scan", "type", "ping", "client|setname",
                            "client|setinfo", "hello"})  # what RedisProbe itself sends


def command_stats(info: Mapping[str, Any]) -> CommandStats:
    """redis-py's parsed `INFO commandstats` as {command: (calls, usec)}."""
    out: CommandStats = {}
    for key, value in info.items():
        if key.startswith("cmdstat_") and isinstance(value, dict):
            out[key[len("cmdstat_"):]] = (int(value.get("calls", 0)), int(value.get("usec", 0)))
    return out


def command_delta(before: CommandStats, after: CommandStats) -> CommandStats:
    """What was called between two snapshots, less the probe's own commands."""
    out: CommandStats = {}
    for name, (calls, usec) in after.items():
        c0, u0 = before.get(name, (0, 0))
        if calls > c0 and name not in PROBE_COMMANDS:
            out[name] = (calls - c0, usec - u0)
    return out


_ID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"
                 r"|\b[0-9a-f]{16,}\b")
_MINUTE = re.compile(r"(?<![\d-])\d{2}-\d{2}(?![\d-])")
_NUMBER = re.compile(r"\b\d{4,}\b")


def key_pattern(key: str) -> str:
    """A Redis key with its ids, minutes (HH-MM) and long numbers replaced by placeholders."""
    return _NUMBER.sub("<n>", _MINUTE.sub("<HH-MM>", _ID.sub("<id>", key)))


def metric_totals(text: str) -> dict[str, float]:
    """Prometheus text exposition: every metric's samples, summed over their labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        try:
            number = float(value)
        except ValueError:
            continue
        name = series.split("{", 1)[0]
        out[name] = out.get(name, 0.0) + number
    return out


def metric_lines(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines()
            if line.startswith((name + "{", name + " "))]


def fetch_metrics(port: int) -> str:
    with httpx.Client(timeout=5.0) as client:
        response = client.get(f"http://127.0.0.1:{port}/metrics")
        response.raise_for_status()
        return response.text


class RedisProbe:
    """A blocking client for the bench's Redis: INFO and SCAN, never inside a timed window."""

    def __init__(self, port: int) -> None:
        import redis

        self.client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5.0)

    def version(self) -> str:
        return str(self.client.info("server")["redis_version"])

    def commands(self) -> CommandStats:
        return command_stats(self.client.info("commandstats"))

    def key_patterns(self) -> dict[str, int]:
        """How many keys match each `key_pattern`."""
        out: dict[str, int] = {}
        for raw in self.client.scan_iter(count=1000):
            pattern = key_pattern(raw.decode(errors="replace"))
            out[pattern] = out.get(pattern, 0) + 1
        return dict(sorted(out.items()))

    def close(self) -> None:
        self.client.close()


def write_plugin(root: Path, module: str, source: str, exporters: dict[str, str]) -> Path:
    """An installed distribution written to ``root``: ``module``.py with ``source`` and its
    dist-info, whose ``exporters`` (entry-point name -> class in the module) are SDK trace
    exporter plugins once ``root`` is on ``sys.path`` / ``PYTHONPATH``
    (``OTEL_TRACES_EXPORTER=<name>`` picks one). Returns ``root``."""
    info = root / f"{module}-1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(source)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\n"
                                   "Version: 1.0\n")
    lines = "".join(f"{name} = {module}:{cls}\n" for name, cls in exporters.items())
    (info / "entry_points.txt").write_text(f"[opentelemetry_traces_exporter]\n{lines}")
    return root
