"""Subcommands of the gateway: `sluice gateway`, `sluice up`, `sluice hash-key`.

Heavy imports happen inside the command functions so that building the parser stays cheap,
and the gateway never loads torch (the bundled backend runs in its own process).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from protocol.limits import ConnectionCounts, ConnectionLimits

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_BACKEND_PORT = 8001
BACKEND_START_TIMEOUT_S = 600.0
# The demo tenants `sluice up` serves when no tenants file is given (configs/tenants.yaml
# holds the same two, as hashes). Demo keys only: anyone who reads this file knows them.
DEMO_KEYS = {"alpha": "sk-demo-alpha", "beta": "sk-demo-beta"}
# The bundled backend's API key (`sluice backend` reads the same variable) and the key of
# the tenants' cache_salt (gateway/cache_salt.py): `sluice up` makes each per run unless set.
BACKEND_KEY_ENV = "SLUICE_BACKEND_API_KEY"
SALT_KEY_ENV = "SLUICE_CACHE_SALT_KEY"


def demo_tenants() -> Any:
    from .config import Caps, PriorityRange, QuotasConfig, TenantEntry, TenantsFile
    from .tenants import hash_key

    return TenantsFile(tenants=[
        TenantEntry(id="alpha", name="Alpha (demo)", keys=[hash_key(DEMO_KEYS["alpha"])],
                    models=["*"], priority=PriorityRange(min=0, max=10, default=5),
                    caps=Caps(max_prompt_tokens=8192, max_tokens=1024, on_exceed="clamp"),
                    quotas=QuotasConfig(tokens_per_minute=500_000, requests_per_minute=1200,
                                        max_concurrency=64, max_queued=256),
                    weight=2.0),
        TenantEntry(id="beta", name="Beta (demo)", keys=[hash_key(DEMO_KEYS["beta"])],
                    models=["*"], priority=PriorityRange(min=5, max=10, default=8),
                    caps=Caps(max_prompt_tokens=4096, max_tokens=512, on_exceed="reject"),
                    quotas=QuotasConfig(tokens_per_minute=50_000, requests_per_minute=120,
                                        tokens_per_day=2_000_000, max_concurrency=8,
                                        max_queued=32),
                    fail_mode="open"),
    ])


def listen_socket(host: str, port: int, send_buffer_bytes: int) -> Any:
    """A bound listening socket whose accepted connections inherit ``SO_SNDBUF``."""
    import socket

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _serve(app: Any, host: str, port: int, log_level: str, access_log: bool,
           shutdown_timeout_s: float, on_ready: Any = None,
           send_buffer_bytes: int | None = None, drain_grace_s: float = 0.0,
           limits: ConnectionLimits | None = None,
           counts: ConnectionCounts | None = None) -> int:
    """Serve until SIGTERM/SIGINT, then drain gracefully and return (exit status 0).

    Drain: /readyz turns 503 and new generation requests get 503 + Retry-After at once;
    for ``drain_grace_s`` the listener stays open (a load balancer sees the 503s and
    stops sending), then uvicorn stops accepting and gives in-flight requests
    ``shutdown_timeout_s`` to finish before cancelling them (they settle as cancelled).
    A second signal skips the grace. ``limits`` (a ``ConnectionLimits``, default its
    defaults) cut slow senders and cap open connections (protocol/server.py), each cut
    counted in ``counts`` (the app's, for /metrics)."""
    import threading

    import uvicorn

    from protocol.server import fit_file_limit, http_protocol

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # uvicorn re-raises a captured signal after shutting down, which would kill us
            # before `sluice up` stops its backend; handle it as a plain graceful exit.
            first = not app.state.draining
            app.state.draining = True  # /readyz turns 503 while in-flight requests finish
            if first and drain_grace_s > 0:
                timer = threading.Timer(drain_grace_s, self._stop_accepting)
                timer.daemon = True
                timer.start()
                return
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

        def _stop_accepting(self) -> None:
            self.should_exit = True

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started and on_ready is not None:
                on_ready()

    limits = limits or ConnectionLimits()
    fit_file_limit(limits)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            access_log=access_log, loop="auto",
                            http=http_protocol(limits, counts),
                            timeout_graceful_shutdown=max(0.1, shutdown_timeout_s),  # type: ignore[arg-type]  # typed int, but uvicorn hands it to asyncio.wait_for: a float works
                            lifespan="on", backlog=4096)
    server = Server(config)
    server.run(sockets=None if send_buffer_bytes is None
               else [listen_socket(host, port, send_buffer_bytes)])
    return 0 if server.started else 1


def _logging(level: str) -> None:
    import logging

    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every upstream request at INFO; the gateway logs what matters itself.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


def _gateway(args: argparse.Namespace) -> int:
    from .app import create_app
    from .config import load_gateway_config, load_tenants
    from .errors import ConfigError

    _logging(args.log_level)
    try:
        config = load_gateway_config(args.config)
        if args.host is not None or args.port is not None:
            listen = config.listen.model_copy(update={
                k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None})
            config = config.model_copy(update={"listen": listen})
        tenants = load_tenants(config.tenants_file)
        counts = ConnectionCounts()
        app = create_app(config, tenants, connections=counts, warm=True)
    except (ConfigError, ValueError) as exc:
        print(f"sluice gateway: cannot start: {exc}", file=sys.stderr)
        return 2
    host, port = config.listen.host, config.listen.port

    def ready() -> None:
        print(f"sluice gateway ready at http://{host}:{port}/v1 "
              f"({len(config.models)} model(s))", flush=True)

    return _serve(app, host, port, args.log_level, args.access_log,
                  config.shutdown_timeout_s, ready, config.listen.send_buffer_bytes,
                  config.drain_grace_s, config.connection_limits(), counts)


# ---- sluice up ------------------------------------------------------------------------------
_BACKEND_FLAGS = ("model", "served_model_name", "device", "dtype", "kv_memory", "kv_blocks",
                  "max_num_seqs", "max_num_batched_tokens", "max_model_len", "threads", "seed")


def _backend_argv(args: argparse.Namespace, port: int) -> list[str]:
    argv = [sys.executable, "-m", "sluice.cli", "backend", "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning"]
    for name in _BACKEND_FLAGS:
        value = getattr(args, name)
        if value is not None:
            argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    # Linux: the backend gets SIGTERM if `sluice up` dies without cleaning up (SIGKILL).
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _bearer(key: str | None) -> dict[str, str]:
    return {} if not key else {"authorization": f"Bearer {key}"}


def _set_if_unset(environ: Any, name: str, make: Callable[[], str]) -> str:
    """``environ[name]``, made by ``make`` first if unset. `sluice up` keeps its per-run keys
    in its own environment: the backend inherits them, the gateway reads them there. They
    are never printed: set them before `sluice up` to know them."""
    if not environ.get(name):
        environ[name] = make()
    return str(environ[name])


def _wait_backend(proc: subprocess.Popen[bytes], url: str, timeout_s: float,
                  key: str) -> dict[str, Any]:
    """Wait until the backend answers /health; returns its /v1/models entry."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the bundled backend exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                listing = httpx.get(url + "/v1/models", timeout=5.0,
                                    headers=_bearer(key)).json()
                entry: dict[str, Any] = listing["data"][0]
                return entry
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the bundled backend did not become healthy in {timeout_s:.0f} s")


def _detect_kind(url: str, name: str, key: str | None) -> Literal["sluice", "openai"]:
    """`sluice` when the upstream is a bundled backend (it reports resolved versions)."""
    import httpx

    try:
        listing = httpx.get(url + "/v1/models", timeout=5.0, headers=_bearer(key)).json()["data"]
        for entry in listing:
            if entry.get("id") == name and isinstance(entry.get("resolved"), dict):
                return "sluice"
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return "openai"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=35)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _curl_line(url: str, model: str, key: str) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}],
                       "max_tokens": 32})
    return (f"  curl -s {url}/v1/chat/completions -H 'authorization: Bearer {key}' "
            f"-H 'content-type: application/json' -d '{body}'")


def up_config(args: argparse.Namespace, entry: Any) -> Any:
    """`sluice up`'s gateway settings: its flags, over the SLUICE_* overrides that apply as
    for `sluice gateway` (e.g. SLUICE_QUEUE__RESERVE_SHARE=0.25)."""
    from pydantic import ValidationError

    from .config import GatewayConfig, apply_env
    from .errors import ConfigError

    raw = apply_env({}, os.environ)
    raw.update(listen={**raw.get("listen", {}), "host": args.host, "port": args.port},
               store={**raw.get("store", {}), "url": args.redis or None,
                      **({"cluster": True} if getattr(args, "redis_cluster", False) else {})},
               models=[entry], tenants_file=Path(args.tenants or "-"))
    try:
        return GatewayConfig.model_validate(raw)
    except ValidationError as exc:
        fields = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                           for e in exc.errors())
        raise ConfigError(f"bad SLUICE_* setting: {fields}") from None


def _up(args: argparse.Namespace) -> int:
    from .app import create_app
    from .config import ModelEntry, load_tenants
    from .errors import ConfigError

    _logging(args.log_level)
    try:
        tenants = load_tenants(args.tenants) if args.tenants else demo_tenants()
    except ConfigError as exc:
        print(f"sluice up: {exc}", file=sys.stderr)
        return 2
    try:  # a bad SLUICE_* override fails before the backend starts; the model comes later
        settings = up_config(args, ModelEntry(name="pending", upstream="http://127.0.0.1:1"))
    except ConfigError as exc:
        print(f"sluice up: {exc}", file=sys.stderr)
        return 2
    proc: subprocess.Popen[bytes] | None = None
    try:
        if args.upstream:
            if not args.model_name:
                print("sluice up: --upstream needs --model-name (the model's name there)",
                      file=sys.stderr)
                return 2
            upstream = args.upstream.rstrip("/").removesuffix("/v1")
            name = args.model_name
            # a keyed upstream (another `sluice backend`): its key in $SLUICE_BACKEND_API_KEY
            upstream_key = os.environ.get(BACKEND_KEY_ENV) or None
            kind = _detect_kind(upstream, name, upstream_key)
            entry = ModelEntry(name=name, upstream=upstream, kind=kind,
                               api_key_env=BACKEND_KEY_ENV if upstream_key else None)
        else:
            key = _set_if_unset(os.environ, BACKEND_KEY_ENV, lambda: secrets.token_urlsafe(32))
            backend_url = f"http://127.0.0.1:{args.backend_port}"
            print(f"starting the bundled backend (model {args.model}) on {backend_url} …",
                  flush=True)
            proc = subprocess.Popen(_backend_argv(args, args.backend_port),
                                    # no threads exist yet, so preexec_fn is safe here
                                    preexec_fn=_die_with_parent if os.name == "posix" else None)  # noqa: PLW1509
            info = _wait_backend(proc, backend_url, BACKEND_START_TIMEOUT_S, key)
            name = str(info["id"])
            tokenizer = "local:tiny" if args.model == "tiny" else f"local:{args.model}"
            entry = ModelEntry(name=name, upstream=backend_url, kind="sluice",
                               tokenizer=tokenizer, api_key_env=BACKEND_KEY_ENV)
        config = settings.model_copy(update={"models": [entry]})
        _set_if_unset(os.environ, SALT_KEY_ENV, lambda: secrets.token_hex(32))
        counts = ConnectionCounts()
        app = create_app(config, tenants, connections=counts, warm=True)
    except (RuntimeError, ValueError, ConfigError) as exc:
        print(f"sluice up: cannot start: {exc}", file=sys.stderr)
        if proc is not None:
            _stop(proc)
        return 2

    shown = "127.0.0.1" if args.host in ("0.0.0.0", "") else args.host
    url = f"http://{shown}:{args.port}"

    def ready() -> None:
        kept = "redis cluster " if config.store.cluster else "redis "
        lines = [(f"sluice is up: model {name} at {url}/v1 (quotas: "
                 f"{kept + args.redis if args.redis else 'in memory'})")]
        if not args.tenants:
            lines.append("demo tenants (keys): " + ", ".join(
                f"{t} = {k}" for t, k in DEMO_KEYS.items()))
            lines.append("try it:")
            lines.append(_curl_line(url, name, DEMO_KEYS["alpha"]))
        print("\n".join(lines), flush=True)

    try:
        return _serve(app, args.host, args.port, args.log_level, args.access_log, 30.0, ready,
                      limits=config.connection_limits(), counts=counts)
    finally:
        if proc is not None:
            _stop(proc)


def _hash_key(args: argparse.Namespace) -> int:
    from .tenants import hash_key

    key = args.key if args.key is not None else sys.stdin.readline().rstrip("\n")
    if not key:
        print("sluice hash-key: give a key (argument or one line on stdin)", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


def register(sub: Any) -> None:
    """Add the gateway's subcommands to the `sluice` parser."""
    g = sub.add_parser("gateway", help="run the gateway (production entry point)")
    g.add_argument("--config", required=True, help="gateway.yaml")
    g.add_argument("--host", default=None, help="override listen.host")
    g.add_argument("--port", type=int, default=None, help="override listen.port")
    g.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--access-log", action="store_true", help="log every request")
    g.set_defaults(func=_gateway)

    up = sub.add_parser("up", help="embedded default: bundled backend (tiny model) + gateway")
    up.add_argument("--host", default=DEFAULT_HOST,
                    help=f"gateway bind address (default {DEFAULT_HOST})")
    up.add_argument("--port", type=int, default=DEFAULT_PORT,
                    help=f"gateway port (default {DEFAULT_PORT})")
    up.add_argument("--backend-port", type=int, default=DEFAULT_BACKEND_PORT,
                    help=f"bundled backend port on 127.0.0.1 (default {DEFAULT_BACKEND_PORT})")
    up.add_argument("--tenants", default=None,
                    help="tenants.yaml (default: the demo tenants alpha and beta)")
    up.add_argument("--redis", default=os.environ.get("SLUICE_REDIS_URL"), metavar="URL",
                    help="keep quotas in Redis (redis://host:port/db; default: in memory, "
                         "or $SLUICE_REDIS_URL)")
    up.add_argument("--redis-cluster", action="store_true",
                    help="--redis names a seed node of a Redis Cluster "
                         "(or $SLUICE_REDIS_CLUSTER=1)")
    up.add_argument("--upstream", default=None, metavar="URL",
                    help="front this OpenAI-compatible server instead of starting the backend")
    up.add_argument("--model-name", default=None, help="with --upstream: the model's name")
    up.add_argument("--model", default="tiny",
                    help="checkpoint directory for the bundled backend, or 'tiny'")
    up.add_argument("--served-model-name", default=None)
    up.add_argument("--device", default=None)
    up.add_argument("--dtype", default=None)
    up.add_argument("--kv-memory", type=float, default=None, metavar="GiB")
    up.add_argument("--kv-blocks", type=int, default=None, metavar="N")
    up.add_argument("--max-num-seqs", type=int, default=None)
    up.add_argument("--max-num-batched-tokens", type=int, default=None)
    up.add_argument("--max-model-len", type=int, default=None)
    up.add_argument("--threads", type=int, default=None)
    up.add_argument("--seed", type=int, default=None)
    up.add_argument("--log-level", default="info",
                    choices=["critical", "error", "warning", "info", "debug"])
    up.add_argument("--access-log", action="store_true")
    up.set_defaults(func=_up)

    h = sub.add_parser("hash-key", help="print the sha256:<hex> form of a key for tenants.yaml")
    h.add_argument("key", nargs="?", default=None, help="the key (default: read from stdin)")
    h.set_defaults(func=_hash_key)

    from .tenants_cli import register as register_tenants  # `sluice tenants`: the admin client
    register_tenants(sub)
