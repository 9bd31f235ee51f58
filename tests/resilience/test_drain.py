"""Graceful drain of a real `sluice gateway` process on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from gateway.tenants import hash_key
from tests.backend.server.conftest import GATEWAY_KEY_ENV, REPO_ROOT, free_port

from .conftest import TEST_KEY, Replica, auth, chat, stream_chat


def test_sigterm_drains_then_cancels_what_is_left(replicas: list[Replica],
                                                  tmp_path: Path) -> None:
    a = replicas[0]
    port = free_port()
    (tmp_path / "tenants.yaml").write_text(yaml.safe_dump({"tenants": [
        {"id": "one", "keys": [hash_key(TEST_KEY)]}]}))
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump({
        "listen": {"port": port}, "tenants_file": "tenants.yaml",
        "drain_grace_s": 1.0, "shutdown_timeout_s": 1.5,
        "models": [{"name": "m", "upstreams": [a.url], "kind": "sluice",
                    "upstream_model": "sluice-tiny", "tokenizer": "local:tiny",
                    "api_key_env": GATEWAY_KEY_ENV}]}))  # set by the replicas fixture
    log = open(tmp_path / "gateway.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "sluice.cli", "gateway", "--config",
                             str(tmp_path / "gateway.yaml"), "--log-level", "warning"],
                            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, \
                (tmp_path / "gateway.log").read_text()
            time.sleep(0.05)
        short = stream_chat(url, chat(60))
        long = stream_chat(url, chat(1900))
        assert short.first.wait(30) and long.first.wait(30)
        os.kill(proc.pid, signal.SIGTERM)
        ready = httpx.get(url + "/readyz", timeout=5)
        assert ready.status_code == 503
        refused = httpx.post(url + "/v1/chat/completions", headers=auth(), timeout=5,
                             json={**chat(4), "stream": False})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert refused.headers["retry-after"] == "1"
        assert proc.wait(timeout=30) == 0
        short.join(10)
        long.join(10)
        assert short.events[-1][1] == "[DONE]" and short.error is None  # finished in time
        assert long.events[-1][1] != "[DONE]"  # cut off at the shutdown timeout …
        deadline = time.monotonic() + 10
        while a.state()["running"]:  # … and aborted in the engine, its KV blocks freed
            assert time.monotonic() < deadline
            time.sleep(0.05)
        s = a.state()
        assert s["kv_blocks_free"] == s["kv_blocks_total"]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
