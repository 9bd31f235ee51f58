"""SIGTERM: stop accepting, let in-flight requests finish up to the timeout, abort the rest."""

from __future__ import annotations

import json
import os
import signal
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
    b = start_backend(tmp_path, "--shutdown-timeout", "0.5")
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
        assert len(rest) < 1000
        assert b.proc.wait(timeout=10) in (0, -signal.SIGTERM)
        assert time.monotonic() - t0 < 5
    finally:
        b.stop()
