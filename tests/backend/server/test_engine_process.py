"""`sluice backend` steps its model in an engine process of its own: that process ends with
the server, and its death fails the open requests (no hang) and makes the server exit with
status 1, for its supervisor to restart it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from .conftest import start_backend


def children_of(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def engine_pid(server_pid: int) -> int:
    (pid,) = children_of(server_pid)
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    assert b"backend.engine.core_process" in cmdline
    return pid


def gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":  # exited, not yet reaped
            return True
        time.sleep(0.05)
    return False


def test_sigterm_stops_the_engine_process_too(tmp_path: Path) -> None:
    backend = start_backend(tmp_path)
    try:
        child = engine_pid(backend.pid)
        r = httpx.post(backend.url + "/v1/completions", timeout=30,
                       json={"model": "sluice-tiny", "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200
    finally:
        code = backend.stop()
    assert code in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
    assert gone(child)


def test_a_dead_engine_process_fails_open_requests_and_the_server_exits(tmp_path: Path) -> None:
    backend = start_backend(tmp_path)
    try:
        child = engine_pid(backend.pid)
        with httpx.Client(base_url=backend.url, timeout=30) as client, client.stream(
                "POST", "/v1/completions",
                json={"model": "sluice-tiny", "prompt": "hi", "max_tokens": 1500,
                      "ignore_eos": True, "stream": True}) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(child, signal.SIGKILL)
            rest = "\n".join(lines)  # the stream ends, with an error event, not a hang
        assert '"error"' in rest and "data: [DONE]" in rest
        # nothing can be served any more: the server exits with status 1, for its
        # supervisor (Compose's restart policy, Kubernetes, systemd) to restart it
        assert backend.proc.wait(timeout=30) == 1
        assert "the engine died" in backend.log()
        assert gone(child)
    finally:
        backend.stop()


def test_engine_in_process_flag_keeps_one_process(tmp_path: Path) -> None:
    backend = start_backend(tmp_path, "--engine-in-process")
    try:
        assert children_of(backend.pid) == []
        r = httpx.post(backend.url + "/v1/completions", timeout=30,
                       json={"model": "sluice-tiny", "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        backend.stop()
