"""`sluice backend --quantization int8`: it serves, names the format in its versions, and
its /v1/state reports fewer weight bytes than the unquantized server's."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from .conftest import Backend, start_backend


def test_a_quantized_backend_serves_and_reports_its_weights(
        backend: Backend, tmp_path: Path, tiny_model_dir: Path) -> None:
    quantized = start_backend(tmp_path, "--quantization", "int8")
    try:
        r = httpx.post(quantized.url + "/v1/completions",
                       json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True},
                       timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert "+int8" in r.headers["x-sluice-resolved"]
        state, plain = quantized.state(), backend.state()
        assert state["resolved"]["engine"].endswith("+int8")
        assert not plain["resolved"]["engine"].endswith("+int8")
        assert 0 < state["weight_bytes"] < plain["weight_bytes"] / 2
        assert r.json()["system_fingerprint"] != httpx.post(
            backend.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 1},
            timeout=30).json()["system_fingerprint"]
    finally:
        assert quantized.stop() in (0, -15)


@pytest.mark.parametrize("value", ["int3", "INT8"])
def test_an_unknown_quantization_does_not_start(tmp_path: Path, value: str) -> None:
    with pytest.raises(RuntimeError, match="invalid choice"):
        start_backend(tmp_path, "--quantization", value, ready_timeout=30)
