"""The servers the overhead bench measures, each a subprocess on a free 127.0.0.1 port.

Each runs in its own session (process group), so that stopping it by PID also stops any
worker it forked, and so that Ctrl-C reaches the bench alone, which then stops them all.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

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
        total = 0
        tick = os.sysconf("SC_CLK_TCK")
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == self.proc.pid:  # field 5, pgrp
                total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / tick

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
               headers: dict[str, str] | None = None) -> None:
    """Poll GET `path` until 200; a dead process or the deadline raises TargetError."""
    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{service.port}{path}"
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if service.proc.poll() is not None:
                raise TargetError(f"{service.name} exited with {service.proc.returncode}:\n"
                                  f"{service.log_tail()}")
            try:
                if client.get(url, headers=headers).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    raise TargetError(f"{service.name} not ready at {url} after {timeout:.0f} s:\n"
                      f"{service.log_tail()}")


def start_fake_upstream(workdir: Path, chunks: int) -> Service:
    port = free_port()
    service = _spawn("fake-upstream",
                     [sys.executable, "-m", "sluice.cli", "fake-upstream", "--port", str(port),
                      "--chunks", str(chunks), "--model", MODEL], port, workdir)
    _ready_or_stop(service, "/health", 30)
    return service


def write_gateway_config(workdir: Path, gw_port: int, up_port: int) -> Path:
    digest = hashlib.sha256(BENCH_KEY.encode()).hexdigest()
    (workdir / "tenants.yaml").write_text(f"""\
tenants:
  - id: bench
    name: Benchmark tenant
    keys: ["sha256:{digest}"]
    models: ["{MODEL}"]
    priority: {{min: 0, max: 10, default: 5}}
    caps: {{max_prompt_tokens: 100000, max_tokens: 100000, on_exceed: reject}}
""")
    config = workdir / "gateway.yaml"
    config.write_text(f"""\
listen: {{host: 127.0.0.1, port: {gw_port}}}
tenants_file: tenants.yaml
models:
  - name: {MODEL}
    upstream: http://127.0.0.1:{up_port}
    kind: openai
    versions: {{revision: fake-rev, tokenizer: bytes, chat_template: none, engine: fake-upstream}}
    tokenizer: bytes
""")
    return config


def start_gateway(workdir: Path, up_port: int) -> Service:
    port = free_port()
    config = write_gateway_config(workdir, port, up_port)
    service = _spawn("gateway", [sys.executable, "-m", "sluice.cli", "gateway", "--config",
                                 str(config), "--log-level", "warning"], port, workdir)
    _ready_or_stop(service, "/healthz", 60)
    return service


# Everything LiteLLM's docs offer to keep a proxy lean, short of code changes: no database
# (so no spend/error logs to write), errors-only logging (which also silences uvicorn's
# access log), the bundled model-cost map instead of a fetch at start, no .env loading.
LITELLM_ENV = {"LITELLM_LOG": "ERROR", "LITELLM_MODE": "PRODUCTION",
               "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
LITELLM_UNSET = ("DATABASE_URL", "DIRECT_URL", "REDIS_HOST", "REDIS_URL")


def write_litellm_config(workdir: Path, up_port: int) -> Path:
    config = workdir / "litellm.yaml"
    config.write_text(f"""\
model_list:
  - model_name: {MODEL}
    litellm_params:
      model: openai/{MODEL}
      api_base: http://127.0.0.1:{up_port}/v1
      api_key: sk-upstream-unused
general_settings:
  master_key: {BENCH_KEY}
  disable_spend_logs: true
  disable_error_logs: true
litellm_settings:
  set_verbose: false
  json_logs: false
  telemetry: false
  request_timeout: 600
""")
    return config


def litellm_argv(binary: str, config: Path, port: int) -> list[str]:
    return [binary, "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
            "--num_workers", "1"]


def start_litellm(workdir: Path, binary: str, up_port: int) -> Service:
    if not Path(binary).exists():
        raise TargetError(f"no LiteLLM at {binary}")
    port = free_port()
    config = write_litellm_config(workdir, up_port)
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
