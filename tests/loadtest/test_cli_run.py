"""`sluice loadtest` as a user runs it (its own process) against a real HTTP server: runs
without a workload file, one-off overrides, closed loop and the concurrency sweep, a probe
that waits out Retry-After, Ctrl-C and SIGTERM (a partial report), and a server that stops
answering mid-run (a report, not a traceback)."""

from __future__ import annotations

import argparse
import asyncio
import email.utils
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest.arrivals import cap_requests, schedule
from loadtest.client import RETRY_MIN_S, ProbeRefused, calibrate
from loadtest.command import add_arguments
from loadtest.overrides import build_workload
from loadtest.workload import WorkloadError, parse_workload
from protocol.http import retry_after_s
from tests.loadtest.sse_server import Reply, SSEServer

REPO_ROOT = Path(__file__).resolve().parents[2]
SMOKE = REPO_ROOT / "configs" / "workloads" / "smoke.yaml"
DEADLINE_S = 60.0


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sluice.cli", "loadtest", *args,
                           "--no-progress"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                          check=False)


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]


@pytest.fixture
def server() -> Iterator[SSEServer]:
    s = SSEServer(lambda idx, body: Reply(chunks=3)).start()
    yield s
    s.stop()


def test_a_run_without_a_workload_file(server: SSEServer, tmp_path: Path) -> None:
    out = tmp_path / "r"
    done = cli("--target", server.url + "/v1", "--rate", "20", "--duration", "1.5",
               "--max-tokens", "3", "--prompt-tokens", "40", "--seed", "4", "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "report.json").read_text())
    details = json.loads((out / "details.json").read_text())
    # the same flags give the same workload, hence the same schedule, as the run used
    w, _ = build_workload(parse("--target", "x", "--rate", "20", "--duration", "1.5",
                                "--max-tokens", "3", "--prompt-tokens", "40", "--seed", "4",
                                "--model", "scripted"))
    planned = schedule(w)
    got = rows(out)
    assert [r["idx"] for r in got] == [p.idx for p in planned]
    assert {(r["input_tokens"], r["output_tokens"]) for r in got} == {(40, 3)}
    assert report["outcomes"]["success"] == len(planned)
    assert details["mode"]["kind"] == "open" and details["mode"]["rate"] == 20
    assert details["workload"] == "cli"


def test_model_comes_from_the_target(tmp_path: Path) -> None:
    models: list[str] = []

    def behave(idx: int, body: dict[str, Any]) -> Reply:
        models.append(body["model"])
        return Reply(chunks=2)

    s = SSEServer(behave).start()
    try:
        done = cli("--target", s.url, "--concurrency", "2", "--requests", "6", "--out",
                   str(tmp_path / "r"))
    finally:
        s.stop()
    assert done.returncode == 0, done.stderr
    assert set(models) == {"scripted"} and len(models) == 6 + 2  # and the two probes


def test_closed_loop_and_concurrency_sweep(server: SSEServer, tmp_path: Path) -> None:
    out = tmp_path / "c"
    done = cli("--target", server.url, "--concurrency", "3", "--requests", "15", "--model",
               "m", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert len(rows(out)) == 15
    assert json.loads((out / "details.json").read_text())["mode"]["concurrency"] == 3

    sweep = tmp_path / "s"
    done = cli("--target", server.url, "--sweep-concurrency", "2,1", "--requests", "6",
               "--model", "m", "--out", str(sweep))
    assert done.returncode == 0, done.stderr
    points = json.loads((sweep / "concurrency.json").read_text())
    assert [p["concurrency"] for p in points] == [1, 2]
    for n in (1, 2):
        assert len(rows(sweep / f"c{n}")) == 6
        mode = json.loads((sweep / f"c{n}" / "details.json").read_text())["mode"]
        assert mode["concurrency"] == n
    page = (sweep / "report.html").read_text()
    assert "data:image/png;base64," in page and "c2/report.html" in page and "<table>" in page


def test_overrides_edit_the_workload_file() -> None:
    base = ("--target", "x")
    w, _ = build_workload(parse(str(SMOKE), *base, "--rate", "8", "--max-tokens", "5",
                                "--prompt-tokens", "30", "--model", "other", "--seed", "9",
                                "--duration", "20", "--warmup", "2", "--cooldown", "3"))
    assert w.mean_rate() == pytest.approx(8) and w.arrival is not None
    assert w.arrival.process == "poisson"  # the file's process, scaled
    assert (w.seed, w.duration_s, w.warmup_s, w.cooldown_s) == (9, 20, 2, 3)
    assert w.model == "other" and all(c.model is None for c in w.classes)
    assert {(i, o) for c in w.classes for i, o, _ in c.length_pairs()} == {(30, 5)}
    w, _ = build_workload(parse(str(SMOKE), *base, "--rate", "3", "--arrival", "constant"))
    assert w.arrival is not None and w.arrival.process == "constant"
    w, _ = build_workload(parse(str(SMOKE), *base, "--concurrency", "5",
                                "--think-time-ms", "100", "--requests", "50"))
    assert (w.concurrency, w.arrival, w.think_time_ms, w.requests) == (5, None, 100, 50)


@pytest.mark.parametrize("argv, message", [
    (("--rate", "-1"), "arrival.rate"),
    (("--rate", "1", "--concurrency", "2"), "exclude each other"),
    (("--concurrency", "0"), "concurrency"),
    (("--rate", "1", "--tokenizer", "/tmp"), "--tokenizer"),
    ((str(SMOKE), "--arrival", "constant"), "--arrival goes with --rate"),
    ((str(SMOKE), "--rate", "nan"), "arrival.rate"),
    (("--rate", "1", "--max-tokens", "0"), "lengths.buckets.0.output"),
    ((), "give --rate R"),
])
def test_bad_overrides_name_the_field(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        build_workload(parse("--target", "x", "--model", "m", *argv))


def test_bad_flag_exits_2(server: SSEServer, tmp_path: Path) -> None:
    done = cli(str(SMOKE), "--target", server.url, "--rate", "-2", "--out", str(tmp_path))
    assert done.returncode == 2 and "arrival.rate" in done.stderr


def test_requests_cap_an_open_loop() -> None:
    w, _ = build_workload(parse("--target", "x", "--model", "m", "--rate", "10",
                                "--requests", "25"))
    capped = cap_requests(w)
    plan = schedule(capped)
    assert len(plan) == 25
    # the schedule ends where the 26th arrival would have come: the rate stays the rate
    assert plan[-1].t < capped.duration_s and capped.duration_s < w.duration_s


def test_retry_after_forms() -> None:
    def wait(**headers: str) -> float:
        h = httpx.Headers({k.replace("_", "-"): v for k, v in headers.items()})
        return retry_after_s(h, now=now)

    now = time.time()
    assert wait(retry_after="2") == 2.0
    assert wait(retry_after_ms="1500", retry_after="2") == 1.5  # Sluice's and OpenAI's first
    assert wait() == 1.0
    assert wait(retry_after="soon") == 1.0 and wait(retry_after="0.5") == 1.0  # not RFC 9110
    assert wait(retry_after=email.utils.formatdate(now + 30, usegmt=True)) == \
        pytest.approx(30, abs=1)
    assert wait(retry_after=email.utils.formatdate(now - 30, usegmt=True)) == 0.0


def test_retry_after_zero_cannot_spin() -> None:
    # "Retry-After: 0" forever: the probe still waits RETRY_MIN_S between tries and gives
    # up when the budget's time is spent (not after a count of zero-length waits)
    s = SSEServer(lambda idx, body: Reply(status=429, headers={"retry-after": "0"})).start()
    w = parse_workload({"duration_s": 1, "model": "m", "arrival": {"process": "constant",
                                                                    "rate": 1},
                        "classes": [{"name": "a", "share": 1, "lengths": {"pairs": [[4, 1]]}}]})
    try:
        with pytest.raises(ProbeRefused, match="HTTP 429"):
            asyncio.run(calibrate(s.url, None, w, wait_s=1.0, say=lambda line: None))
    finally:
        s.stop()
    assert 2 <= s.requests <= 1.0 / RETRY_MIN_S + 1


def test_the_probe_waits_out_retry_after() -> None:
    refusals = 2

    def behave(idx: int, body: dict[str, Any]) -> Reply:
        nonlocal refusals
        if refusals:
            refusals -= 1
            return Reply(status=429, headers={"retry-after": "1"})
        return Reply(chunks=1)

    s = SSEServer(behave).start()
    said: list[str] = []
    w = parse_workload({"duration_s": 1, "model": "m", "arrival": {"process": "constant",
                                                                    "rate": 1},
                        "classes": [{"name": "a", "share": 1, "lengths": {"pairs": [[4, 1]]}}]})
    try:
        cal, continuous = asyncio.run(calibrate(s.url, None, w, wait_s=10, say=said.append))
    finally:
        s.stop()
    assert continuous and cal.per_word > 0
    assert len(said) == 2 and all("Retry-After" in line for line in said)
    # two refusals, then the two probes; each retry left at least 1 s after its refusal
    assert s.requests == 4
    gaps = [b - a for a, b in zip(s.arrived, s.arrived[1:])]
    assert gaps[0] >= 1.0 and gaps[1] >= 1.0


def test_a_probe_refused_past_its_budget_exits_1(tmp_path: Path) -> None:
    s = SSEServer(lambda idx, body: Reply(status=503, headers={"retry-after": "100"})).start()
    try:
        done = cli("--target", s.url, "--rate", "1", "--duration", "1", "--model", "m",
                   "--probe-wait", "5", "--out", str(tmp_path / "r"))
    finally:
        s.stop()
    assert done.returncode == 1
    assert "HTTP 503 with Retry-After 100" in done.stderr
    assert s.requests == 1  # 100 s is past the 5 s budget: no wait, no retry
    w = parse_workload({"duration_s": 1, "model": "m", "arrival": {"process": "constant",
                                                                    "rate": 1},
                        "classes": [{"name": "a", "share": 1, "lengths": {"pairs": [[4, 1]]}}]})
    s = SSEServer(lambda idx, body: Reply(status=429)).start()
    try:
        with pytest.raises(ProbeRefused, match="HTTP 429"):
            asyncio.run(calibrate(s.url, None, w, wait_s=2.5, say=lambda line: None))
    finally:
        s.stop()
    assert s.requests == 3  # no Retry-After: 1 s each, twice, then the budget is spent


def wait_for(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_writes_a_partial_report(sig: signal.Signals, tmp_path: Path) -> None:
    # every 7th request hangs: some are in flight when the signal comes, and are dropped
    s = SSEServer(lambda idx, body: Reply(chunks=2, hang=idx % 7 == 5)).start()
    out = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, "-m", "sluice.cli", "loadtest", "--target", s.url,
                             "--rate", "20", "--duration", "120", "--model", "m",
                             "--out", str(out), "--no-progress"], cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: s.requests >= 2 + 12, "the run never got going")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        s.stop()
    assert proc.returncode == 130, err
    report = json.loads((out / "report.json").read_text())
    assert report["partial"] is True and report["notes"][0].startswith("partial:")
    got = rows(out)
    hung = {r["idx"] for r in got if r["idx"] % 7 == 5}
    assert not hung  # in flight at the interrupt: dropped, never counted as errors
    assert got and all(r["outcome"] == "success" for r in got)
    assert len(got) <= s.requests - 2
    assert sum(report["outcomes"].values()) == len(got)  # no warmup: every row is measured
    assert "in flight were dropped" in report["notes"][0]


def test_a_server_that_stops_answering_gives_a_report(tmp_path: Path) -> None:
    # from the 8th request on, even ones hang and odd ones lose their connection
    def behave(idx: int, body: dict[str, Any]) -> Reply:
        if idx < 8:
            return Reply(chunks=2)
        return Reply(hang=idx % 2 == 0, drop=idx % 2 == 1)

    s = SSEServer(behave).start()
    out = tmp_path / "r"
    try:
        done = cli("--target", s.url, "--rate", "10", "--duration", "1.6", "--arrival",
                   "constant", "--model", "m", "--timeout", "3", "--out", str(out))
    finally:
        s.stop()
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    report = json.loads((out / "report.json").read_text())
    got = rows(out)
    assert len(got) == 16
    late = [r for r in got if r["idx"] >= 8]
    assert report["outcomes"]["success"] == 8
    assert report["outcomes"]["timeout"] == sum(r["idx"] % 2 == 0 for r in late)
    assert report["outcomes"]["error"] == sum(r["idx"] % 2 == 1 for r in late)


def test_sweep_refuses_a_request_cap(server: SSEServer, tmp_path: Path) -> None:
    done = cli(str(SMOKE), "--target", server.url, "--sweep", "--requests", "50",
               "--out", str(tmp_path))
    assert done.returncode == 2 and "requests:" in done.stderr


def test_dataset_flags_edit_the_files_dataset(tmp_path: Path) -> None:
    doc = {"duration_s": 5, "arrival": {"process": "poisson", "rate": 1},
           "dataset": {"path": "data.jsonl", "order": "sequential", "sample": 5},
           "classes": [{"name": "a", "share": 1, "lengths": {"pairs": [[4, 2]]}}]}
    path = tmp_path / "w.yaml"
    path.write_text(json.dumps(doc))
    w, base = build_workload(parse(str(path), "--target", "x", "--dataset-sample", "9",
                                   "--dataset-max-input", "300", "--tokenizer", "tok"))
    assert w.dataset is not None and base == tmp_path
    assert (w.dataset.path, w.dataset.order, w.dataset.sample) == ("data.jsonl",
                                                                   "sequential", 9)
    assert w.dataset.max_input_tokens == 300 and w.dataset.tokenizer == str(Path("tok")
                                                                            .resolve())
    w, _ = build_workload(parse(str(path), "--target", "x", "--dataset", "other.jsonl"))
    assert w.dataset is not None and w.dataset.path == str(Path("other.jsonl").resolve())
    assert w.dataset.sample is None  # --dataset FILE replaces the file's dataset
    with pytest.raises(WorkloadError, match="apply to a dataset"):
        build_workload(parse(str(SMOKE), "--target", "x", "--dataset-sample", "3"))
