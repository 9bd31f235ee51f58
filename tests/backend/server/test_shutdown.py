"""SIGTERM: stop accepting, let in-flight requests finish up to the timeout, abort the rest."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .conftest import start_backend


def test_sigterm_lets_in_flight_requests_finish(tiny_model_dir: Path, tmp_path: Path) -> None:
    b = start_backend(tmp_path, "--shutdown-timeout", "20")
    try:
        body = {"prompt": "drain", "max_tokens": 200, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        events: list[str] = []
        with httpx.Client(base_url=b.url, timeout=30) as c, \
                c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line)
                    break
            os.kill(b.pid, signal.SIGTERM)
            time.sleep(0.3)
            with pytest.raises(httpx.ConnectError):  # no longer accepting
                httpx.get(b.url + "/health", timeout=2)
            events.extend(ln for ln in lines if ln.startswith("data: "))
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 200
        last = json.loads(events[-3][6:])
        assert last["choices"][0]["finish_reason"] == "length"
        assert b.proc.wait(timeout=15) in (0, -signal.SIGTERM)  # uvicorn re-raises it
    finally:
        b.stop()


def test_sigterm_aborts_what_outlives_the_timeout(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Every step takes at least 2 ms (a slow server, whatever this machine's speed): the
    # 1900 tokens take 3.8 s or more, far past the 0.5 s timeout.
    b = start_backend(tmp_path, "--shutdown-timeout", "0.5", "--fault-step-delay", "2")
    try:
        body = {"prompt": "forever", "max_tokens": 1900, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=b.url, timeout=30) as c, \
                c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(ln for ln in lines if ln.startswith("data: "))
            t0 = time.monotonic()
            os.kill(b.pid, signal.SIGTERM)
            rest = [ln for ln in lines if ln.startswith("data: {")]
        # Cut short with an in-stream error (the openai SDK raises APIError on it).
        error = json.loads(rest[-1][6:])["error"]
        assert error["code"] == "aborted" and error["type"] == "server_error"
        assert len(rest) < 1000  # cut short: ~0.5 s of 2 ms steps
        assert b.proc.wait(timeout=10) in (0, -signal.SIGTERM)
        assert time.monotonic() - t0 < 5
    finally:
        b.stop()


def test_the_drain_grace_refuses_new_work_with_retry_after_then_closes(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    b = start_backend(tmp_path, "--drain-grace", "1.5", "--shutdown-timeout", "20")
    try:
        body = {"prompt": "drain", "max_tokens": 120, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=b.url, timeout=30) as c, \
                c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(ln for ln in lines if ln.startswith("data: "))
            os.kill(b.pid, signal.SIGTERM)
            time.sleep(0.3)
            # still listening during the grace: health says draining, new work gets 503
            health = httpx.get(b.url + "/health", timeout=5)
            assert health.status_code == 503 and health.json()["status"] == "draining"
            refused = httpx.post(b.url + "/v1/completions", timeout=5,
                                 json={"prompt": "new", "max_tokens": 4})
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "draining"
            assert refused.headers["retry-after"] == "1"
            assert refused.headers["retry-after-ms"] == "1000"
            rest = [ln for ln in lines if ln.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"  # the request in flight finished
        assert b.proc.wait(timeout=15) in (0, -signal.SIGTERM)
        with pytest.raises(httpx.ConnectError):  # and the listener is gone
            httpx.get(b.url + "/health", timeout=2)
    finally:
        b.stop()


def test_a_negative_drain_grace_is_refused() -> None:
    out = subprocess.run([sys.executable, "-m", "sluice.cli", "backend", "--model", "tiny",
                          "--drain-grace", "-1"], check=False, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "--drain-grace" in out.stderr
