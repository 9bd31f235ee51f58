"""The compose topology without Docker: redis-server, one bundled backend, two paced fake
upstreams, two `sluice gateway` replicas sharing Redis, and nginx in front, every process on
a free 127.0.0.1 port in its own session, stopped by PID.

nginx runs in the foreground (`daemon off`, prefix, pid and logs in the test's directory)
with a main config written here and the shipped proxy settings included verbatim from
docker/nginx-proxy.conf (compose's main config resolves Docker DNS, which a test cannot).
A second nginx server block is the control: the same proxy settings with buffering and
gzip forced on, to show that the streaming measurement notices a proxy that holds back.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gateway.tenants import hash_key
from loadtest.targets import (
    REPO_ROOT,
    Service,
    _spawn,
    free_port,
    start_redis,
    wait_ready,
)

PROXY_CONF = REPO_ROOT / "docker" / "nginx-proxy.conf"
ADMIN_KEY = "sk-deploy-operator"
# as docker/compose.yaml passes them: the backend's key to it and to both gateways, and one
# cache-salt key shared by the replicas (each refuses to start without it: replicas = 2)
BACKEND_KEY = "sk-deploy-backend"
SALT_KEY = "deploy-cache-salt-key-0123456789abcdef"
OPEN_KEY = "sk-deploy-open"  # tenant `open`: no quotas
METERED_KEY = "sk-deploy-metered"  # tenant `metered`: tokens_per_minute = METERED_TPM
METERED_TPM = 300
TINY = "sluice-tiny"
PACED = "paced"  # the fake upstream: PACED_CHUNKS content chunks, PACED_DELAY_MS apart
PACED_CHUNKS = 24
PACED_DELAY_MS = 25
LONG = "paced-long"  # the same pace, LONG_CHUNKS chunks (~2 s): in flight while a replica dies
LONG_CHUNKS = 80
UPSTREAM_HEADER = "x-test-upstream"  # added by the test's nginx: which replica answered
# The control server's changes to the shipped settings: what makes a proxy hold a token
# stream back. (Buffering alone does not, in nginx: it still passes on what it has read;
# gzip without the flushes of unbuffered proxying compresses into full buffers first.)
CONTROL = {
    "proxy_buffering off;": "proxy_buffering on;\nproxy_ignore_headers X-Accel-Buffering;",
    "gzip off;": "gzip on;\ngzip_types text/event-stream;\ngzip_min_length 1;",
}


@dataclass
class Topology:
    redis: Service
    backend: Service
    paced: Service
    long: Service
    gateways: list[Service]
    nginx: Service
    nginx_port: int
    control_port: int
    services: list[Service] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.nginx_port}"

    @property
    def control_url(self) -> str:
        return f"http://127.0.0.1:{self.control_port}"

    def gateway_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.gateways[i].port}"

    def replica_of(self, upstream_addr: str) -> int:
        """Which gateway an `x-test-upstream` value (nginx's $upstream_addr) names."""
        ports = [g.port for g in self.gateways]
        return ports.index(int(upstream_addr.rsplit(":", 1)[1]))

    def stop(self) -> None:
        for service in reversed(self.services):
            service.stop()


def spawn(name: str, argv: list[str], port: int, workdir: Path,
          env: dict[str, str] | None = None) -> Service:
    """A child in its own session (stopping it stops its workers); SLUICE_* and OTEL_*
    variables of the caller are dropped, so each process runs on its own config only."""
    return _spawn(name, argv, port, workdir, env,
                  unset=tuple(k for k in os.environ if k.startswith(("SLUICE_", "OTEL_"))
                              and k not in (env or {})))


def write_configs(workdir: Path, redis_url: str, backend_port: int, paced_ports: list[int],
                  ports: list[int]) -> list[Path]:
    (workdir / "tenants.yaml").write_text(json.dumps({"tenants": [
        {"id": "open", "keys": [hash_key(OPEN_KEY)]},
        {"id": "metered", "keys": [hash_key(METERED_KEY)],
         "quotas": {"tokens_per_minute": METERED_TPM}},
    ]}))
    configs = []
    for i, port in enumerate(ports):
        path = workdir / f"gateway{i}.yaml"
        path.write_text(json.dumps({
            "listen": {"host": "127.0.0.1", "port": port},
            "tenants_file": "tenants.yaml",
            "store": {"url": redis_url, "replicas": len(ports), "timeout_s": 1.0},
            "admin": {"poll_interval_s": 0.25},
            "shutdown_timeout_s": 2,
            "models": [
                {"name": TINY, "upstream": f"http://127.0.0.1:{backend_port}", "kind": "sluice",
                 "tokenizer": "local:tiny", "api_key_env": "SLUICE_BACKEND_API_KEY"},
                *({"name": name, "upstream": f"http://127.0.0.1:{port}", "kind": "openai",
                   "tokenizer": "bytes",
                   "versions": {"revision": "r1", "tokenizer": "bytes", "engine": "fake"}}
                  for name, port in zip((PACED, LONG), paced_ports, strict=True)),
            ]}))
        configs.append(path)
    return configs


def nginx_conf(workdir: Path, gateway_ports: list[int], port: int, control_port: int) -> Path:
    """The test's main config; both server blocks include the shipped proxy settings (the
    control's copy with buffering forced on)."""
    shipped = PROXY_CONF.read_text()
    control = shipped
    for setting, buffering in CONTROL.items():
        if setting not in control:
            raise AssertionError(f"{PROXY_CONF} no longer says `{setting}`")
        control = control.replace(setting, buffering)
    (workdir / "control-proxy.conf").write_text(control)
    servers = "\n".join(f"        server 127.0.0.1:{p} max_fails=1 fail_timeout=5s;"
                        for p in gateway_ports)
    temp = "\n".join(f"    {kind}_temp_path {workdir}/{kind}_temp;"
                     for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    user = "user root root;\n" if os.geteuid() == 0 else ""
    conf = workdir / "nginx.conf"
    conf.write_text(f"""\
{user}daemon off;
worker_processes 1;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
events {{ worker_connections 512; }}
http {{
    access_log off;
{temp}
    upstream sluice_gateways {{
{servers}
        keepalive 16;
    }}
    server {{
        listen 127.0.0.1:{port};
        add_header {UPSTREAM_HEADER} $upstream_addr always;
        include {PROXY_CONF};
    }}
    server {{
        listen 127.0.0.1:{control_port};
        add_header {UPSTREAM_HEADER} $upstream_addr always;
        include {workdir}/control-proxy.conf;
    }}
}}
""")
    return conf


def start_topology(workdir: Path) -> Topology:
    """Start everything (slow starters in parallel); on any failure stop what started."""
    from modelfiles.tiny_model import ensure_tiny_model

    nginx = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None)
    if nginx is None:
        raise RuntimeError("nginx is not installed (`make test` installs it from apt)")
    ensure_tiny_model()  # before the backend and both gateways race to build it
    started: list[Service] = []
    try:
        redis = start_redis(workdir)
        started.append(redis)
        sluice = [sys.executable, "-m", "sluice.cli"]
        backend_port, paced_port, long_port = free_port(), free_port(), free_port()
        backend = spawn("backend", [*sluice, "backend", "--model", "tiny", "--port",
                                    str(backend_port), "--threads", "1",
                                    "--log-level", "warning"], backend_port, workdir,
                        env={"SLUICE_BACKEND_API_KEY": BACKEND_KEY})
        started.append(backend)
        paced = spawn("paced", [*sluice, "fake-upstream", "--port", str(paced_port),
                                "--chunks", str(PACED_CHUNKS), "--delay-ms",
                                str(PACED_DELAY_MS), "--model", PACED], paced_port, workdir)
        started.append(paced)
        long = spawn("long", [*sluice, "fake-upstream", "--port", str(long_port),
                              "--chunks", str(LONG_CHUNKS), "--delay-ms", str(PACED_DELAY_MS),
                              "--model", LONG], long_port, workdir)
        started.append(long)
        # The gateways read the backend's versions at start: start them once it answers.
        wait_ready(backend, "/health", 120)
        wait_ready(paced, "/health", 60)
        wait_ready(long, "/health", 60)
        ports = [free_port(), free_port()]
        configs = write_configs(workdir, f"redis://127.0.0.1:{redis.port}/0", backend_port,
                                [paced_port, long_port], ports)
        gateways = []
        for i, (port, config) in enumerate(zip(ports, configs, strict=True)):
            gateways.append(spawn(f"gateway{i}", [*sluice, "gateway", "--config", str(config),
                                                  "--log-level", "warning"], port, workdir,
                                  env={"SLUICE_ADMIN_KEY": ADMIN_KEY,
                                       "SLUICE_BACKEND_API_KEY": BACKEND_KEY,
                                       "SLUICE_CACHE_SALT_KEY": SALT_KEY}))
            started.append(gateways[-1])
        for gateway in gateways:
            wait_ready(gateway, "/healthz", 120)
        port, control_port = free_port(), free_port()
        conf = nginx_conf(workdir, ports, port, control_port)
        proxy = spawn("nginx", [nginx, "-p", str(workdir), "-c", str(conf),
                                "-e", str(workdir / "nginx-error.log")], port, workdir)
        started.append(proxy)
        wait_ready(proxy, "/nginx-health", 20)
        return Topology(redis, backend, paced, long, gateways, proxy, port, control_port,
                        started)
    except BaseException:
        for service in reversed(started):
            service.stop()
        raise
