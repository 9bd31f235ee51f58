"""`configs/workloads/smoke.yaml` end to end: `sluice loadtest` (the real command, its own
process) against a real `sluice up` (gateway + bundled backend), writing every artifact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.stats import OUTCOMES
from loadtest.summary import CLASS_KEYS, REPORT_KEYS
from loadtest.workload import load_workload
from tests.gateway.conftest import SluiceUp, start_sluice_up

REPO_ROOT = Path(__file__).resolve().parents[2]
SMOKE = REPO_ROOT / "configs" / "workloads" / "smoke.yaml"
ARTIFACTS = ("report.json", "details.json", "requests.jsonl", "report.md", "report.html",
             "latency_cdf.png", "goodput_vs_load.png", "timeline.png", "outcomes.png")


def loadtest(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sluice.cli", "loadtest", *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, check=False)


@pytest.fixture(scope="module")
def sluice_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceUp]:
    from modelfiles.tiny_model import ensure_tiny_model

    ensure_tiny_model()
    up = start_sluice_up(tmp_path_factory.mktemp("up"))
    yield up
    assert up.stop() == 0


def test_smoke_against_sluice_up(sluice_up: SluiceUp, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "report"
    assert sluice_up.backend_key is not None
    # the backend's /metrics needs its key: --scrape sends $SLUICE_BACKEND_API_KEY
    monkeypatch.setenv("SLUICE_BACKEND_API_KEY", sluice_up.backend_key)
    done = loadtest(str(SMOKE), "--target", sluice_up.url + "/v1", "--out", str(out),
                    "--scrape", sluice_up.backend_url, "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "goodput" in done.stdout
    for name in ARTIFACTS:
        assert (out / name).stat().st_size > 0, name
    for png in ARTIFACTS[5:]:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    report = json.loads((out / "report.json").read_text())
    assert tuple(report) == REPORT_KEYS
    w = load_workload(SMOKE)
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    measured = [r for r in rows if r["measured"]]
    # every arrival in the window has exactly one outcome
    assert set(report["outcomes"]) == set(OUTCOMES)
    assert sum(report["outcomes"].values()) == len(measured) > 0
    assert report["offered_rps"] == round(len(measured) / 6.0, 4)
    # the tiny model on an idle gateway serves the smoke load
    assert report["outcomes"]["success"] >= 0.8 * len(measured), report["outcomes"]
    assert report["goodput_rps"] > 0 and report["cost_per_success"] > 0
    assert set(report["classes"]) == {c.name for c in w.classes}
    for cls in report["classes"].values():
        assert tuple(cls) == CLASS_KEYS
        assert cls["ttft_ms"]["p50"] is not None and cls["e2e_ms"]["p99"] is not None
    assert all(r["output_tokens"] > 0 for r in measured if r["outcome"] == "success")

    details = json.loads((out / "details.json").read_text())
    assert set(details["tenants"]) == {"alpha", "beta"}
    assert set(details["priorities"]) == {"1", "8"}
    # /metrics of the gateway and of the backend, on the run's timeline
    urls = {s["url"] for s in details["scraped"]}
    assert urls == {sluice_up.url + "/metrics", sluice_up.backend_url + "/metrics"}
    assert any("kv_usage" in s for s in details["scraped"])
    assert details["calibration"]["continuous_usage"] is True
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 4 and "<table>" in page


def test_bad_workload_names_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(SMOKE.read_text().replace("process: poisson", "process: fractal"))
    done = loadtest(str(bad), "--target", "http://127.0.0.1:9", "--out", str(tmp_path / "o"))
    assert done.returncode == 2
    assert "arrival.process" in done.stderr
