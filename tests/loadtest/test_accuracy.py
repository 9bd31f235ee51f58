"""The load client against a scripted server: what it measures is what the server did.

The server (loadtest/scripted_server.py, its own process) answers with a fixed TTFT, fixed gaps,
chunks of several tokens, and a known share of 429s and 503s, and logs when it really read
each request and wrote each chunk, on the machine's monotonic clock, the one the client
stamps with. Every check here is exact or causal, never a wall-clock tolerance: this
machine's two cores are shared, so either process may run late by tens of ms, and how late
says nothing about the client's code. So:

* outcome counts, token counts per chunk (from the running usage, not one chunk = one
  token), TTFT/TPOT/ITL/E2E as the definitions in docs/loadtest.md applied to the
  client's own stamps, and the report's P50s: exact;
* every stamp lies on the far side of the server event that caused it (a chunk's arrival
  after its write, the [DONE] after the server's last write, the request's dispatch
  before the server read it): the client never times from anything earlier, such as the
  schedule;
* each stamp is taken when the transport hands the bytes over, before the client asks for
  more (`test_each_event_is_stamped_when_its_bytes_are_handed_over`, sandwiched between
  the two moments): never after parsing, never at the end of the stream.

Abandonment never races the script either: the server sends an impatient request no token
and a skimmer nothing past its 5th token until the client has left (``sk-hold-after-N``
keys), and never rejects a request with such a key (a 429 would race the patience), so
that which outcome each request gets does not depend on who ran late. The SLOs of the
classes that should meet them are twice the client's timeout: an answer that came back in
time meets them however late either process ran. (Checked by pausing the server or the
client with SIGSTOP for 0.6 s at random moments: the outcomes and every check still hold.)

A wrong definition (one chunk = one token, timing from the schedule, stamping late) fails
one of these on any machine, at any load.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest import scripted_server as script
from loadtest.arrivals import Planned, schedule
from loadtest.client import CANCEL_PATIENCE, CANCEL_TOKENS, Record, send_one
from loadtest.run import measure_workload
from loadtest.stats import OUTCOMES, Measured
from loadtest.workload import Workload, parse_workload
from tests.backend.server.conftest import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 10.0  # the client's, per request
LOG_DEADLINE_S = 10.0  # a held stream's row lands when the server sees its client leave
PATIENCE_MS = 500
# perf_counter() values from two processes compare only on one system-wide clock
ONE_CLOCK = time.get_clock_info("perf_counter").implementation == "clock_gettime(CLOCK_MONOTONIC)"
CHUNK_TOKENS = [1] + [script.TOKENS_PER_CHUNK] * script.CHUNKS
EPS_MS = 1e-6  # float rounding of the same arithmetic done in another order
SLEEP_EPS_S = 1e-6  # float rounding of perf_counter() seconds around a sleep's deadline


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    port = free_port()
    log = tmp_path_factory.mktemp("scripted") / "writes.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "loadtest.scripted_server", str(port),
                             str(log)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        yield f"http://127.0.0.1:{port}", log
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


def workload() -> Workload:
    # met by any answer that beat the client's timeout, whoever ran late (see the top)
    slack = dict.fromkeys(("ttft_ms", "tpot_ms", "e2e_ms"), 2 * TIMEOUT_S * 1000)
    one = {"buckets": [{"input": 40, "output": script.OUTPUT_TOKENS}]}
    return parse_workload({
        "name": "scripted", "seed": 3, "duration_s": 2.0, "model": "m",
        "arrival": {"process": "constant", "rate": 20},
        "cost": {"machine_hour_usd": 3.6},
        "classes": [
            {"name": "ok", "share": 2, "slo": slack, "lengths": one, "tenant": "a",
             "priority": 0},
            # the script's TTFT is 80 ms: this SLO is missed by every answer (measured from
            # the client's send, which is before the server read the request)
            {"name": "tight", "share": 1, "slo": {"ttft_ms": 1}, "lengths": one,
             "tenant": "b", "priority": 5},
            # the server sends them no token and never rejects them: every one is abandoned
            # at its patience
            {"name": "impatient", "share": 1, "slo": slack, "lengths": one, "tenant": "a",
             "key": script.HOLD_KEY + "0",
             "cancel": {"share": 1.0, "patience_ms": {"dist": "fixed", "median": PATIENCE_MS}}},
            # leaves after 5 tokens: the third chunk (1 + 3 + 3 tokens) ends it, and the
            # server sends nothing after it until the skimmer has left
            {"name": "skimmer", "share": 1, "slo": slack, "lengths": one, "tenant": "b",
             "key": script.HOLD_KEY + "5", "cancel": {"share": 1.0, "after_tokens": 5}},
        ]})


def expected_outcomes(w: Workload) -> dict[str, int]:
    counts = dict.fromkeys(OUTCOMES, 0)
    for p in schedule(w):
        status = script.status_for(p.idx, w.class_named(p.cls).key or "")
        if status == 429:
            counts["rejected_429"] += 1
        elif status == 503:
            counts["rejected_503"] += 1
        elif p.cls in ("impatient", "skimmer"):
            counts["cancelled"] += 1
        elif p.cls == "tight":
            counts["slo_miss"] += 1
        else:
            counts["success"] += 1
    return counts


def server_rows(log: Path, idxs: set[int]) -> dict[int, dict[str, Any]]:
    """idx -> what the server did for it; waits (bounded) for the rows of cancelled
    streams, which the server writes when it notices the client left."""
    deadline = time.monotonic() + LOG_DEADLINE_S
    while True:
        rows = {row["idx"]: row for row in map(json.loads, log.read_text().splitlines())}
        if idxs <= rows.keys() or time.monotonic() > deadline:
            assert idxs <= rows.keys(), sorted(idxs - rows.keys())
            return rows
        time.sleep(0.05)


def check_against_server(rec: Record, row: dict[str, Any], n_chunks: int) -> None:
    """The client's stamps for the first `n_chunks` chunks each follow the server's write
    of that chunk, and the server kept to the script (its sleeps never end early)."""
    read_at, chunk_at = row["read_at"], row["chunk_at"]
    assert len(chunk_at) >= n_chunks
    for k, at in enumerate(chunk_at):
        assert at >= read_at + (script.TTFT_MS + k * script.GAP_MS) / 1000 - SLEEP_EPS_S
    assert rec.dispatched < read_at  # it left the client before the server had read it
    stamps = [t for t, _ in rec.events]
    assert stamps == sorted(stamps) and rec.sent <= stamps[0]
    for k in range(n_chunks):
        assert chunk_at[k] < stamps[k], (k, chunk_at[k], stamps[k])


def check_definitions(rec: Record, x: Measured) -> None:
    """TTFT, TPOT, ITL and E2E as docs/loadtest.md defines them, from the client's stamps."""
    stamps = [t for t, _ in rec.events]
    assert x.ttft_ms == pytest.approx((stamps[0] - rec.sent) * 1000, abs=EPS_MS)
    assert x.tpot_ms == pytest.approx(
        (stamps[-1] - stamps[0]) * 1000 / (script.OUTPUT_TOKENS - 1), abs=EPS_MS)
    # one ITL per token after the first: a 3-token chunk g ms after the last gives 3 x g/3
    itl = [(b - a) * 1000 / n for (a, _), (b, n) in itertools.pairwise(rec.events)
           for _ in range(n)]
    assert len(x.itl_ms) == script.OUTPUT_TOKENS - 1
    assert list(x.itl_ms) == pytest.approx(itl, abs=EPS_MS)
    assert x.e2e_ms == pytest.approx((rec.done - rec.sent) * 1000, abs=EPS_MS)


def p50(values: list[float]) -> float:
    return round(statistics.median(values), 3)


@pytest.mark.skipif(not ONE_CLOCK, reason="needs one monotonic clock shared by processes")
def test_metrics_match_the_script(server: tuple[str, Path]) -> None:
    url, log = server
    w = workload()
    m = asyncio.run(measure_workload(w, url, "sk-x", timeout_s=TIMEOUT_S, progress=False))
    report = m.report
    want = expected_outcomes(w)
    assert sum(want.values()) == 40
    assert want["rejected_429"] == 3 and want["rejected_503"] == 3
    assert report["outcomes"] == want
    assert m.details["calibration"]["continuous_usage"] is True
    assert abs(m.details["calibration"]["overhead_tokens"] - script.PROMPT_OVERHEAD) < 0.01

    pairs = list(zip(m.result.records, m.measured, strict=True))
    streamed = [(r, x) for r, x in pairs
                if script.status_for(r.plan.idx, w.class_named(r.plan.cls).key or "") == 200]
    # A client that gave up before its request was written in full (the trace hook never
    # moved `sent` past `dispatched`: a client stalled past its patience) may leave no row.
    written = [(r, x) for r, x in streamed if r.sent > r.dispatched]
    rows = server_rows(log, {r.plan.idx for r, _ in written})
    served = [(r, x) for r, x in pairs if x.outcome in ("success", "slo_miss")]
    assert len(served) == want["success"] + want["slo_miss"]
    for rec, x in served:
        row = rows[rec.plan.idx]
        # one event per chunk, its tokens from the running usage
        assert [n for _, n in rec.events] == CHUNK_TOKENS
        assert x.output_tokens == script.OUTPUT_TOKENS and not x.tokens_estimated
        check_against_server(rec, row, len(CHUNK_TOKENS))
        assert row["done_at"] is not None and row["done_at"] < rec.done
        check_definitions(rec, x)
        assert x.queue_ms == 7
        assert x.prompt_tokens is not None and abs(x.prompt_tokens - 40) <= 1

    # the report's P50s are those of the per-request values (each rounded to the µs)
    ok = report["classes"]["ok"]
    mine = [x for r, x in pairs if r.plan.cls == "ok" and r.plan.measured]
    for name, values in (("ttft_ms", [x.ttft_ms for x in mine]),
                         ("tpot_ms", [x.tpot_ms for x in mine]),
                         ("itl_ms", [v for x in mine for v in x.itl_ms]),
                         ("e2e_ms", [x.e2e_ms for x in mine]),
                         ("queue_ms", [x.queue_ms for x in mine])):
        assert ok[name]["p50"] == pytest.approx(p50([v for v in values if v is not None]),
                                                abs=1e-3), (name, ok[name])
    assert ok["queue_ms"]["p50"] == 7.0

    # skimmers got their first tokens (TTFT measured) but no E2E: they left mid-stream, on
    # the chunk that brought their 5th token, and before the server saw them go
    skim = [(r, x) for r, x in streamed if r.plan.cls == "skimmer"]
    assert skim
    for rec, x in skim:
        row = rows[rec.plan.idx]
        assert rec.cancelled == CANCEL_TOKENS and x.outcome == "cancelled"
        assert x.e2e_ms is None and not rec.finished
        assert [n for _, n in rec.events] == CHUNK_TOKENS[:3]
        check_against_server(rec, row, 3)
        assert row["left_at"] is not None and rec.events[-1][0] < row["left_at"]
        assert x.ttft_ms == pytest.approx((rec.events[0][0] - rec.sent) * 1000, abs=EPS_MS)
    # the impatient got no token and left at their patience, before the server saw them go
    # (if the server read the request only after that, a read or a write then finds it gone)
    impatient = [r for r, _ in streamed if r.plan.cls == "impatient"]
    assert impatient
    for rec in impatient:
        assert rec.cancelled == CANCEL_PATIENCE and not rec.events
        assert rec.done - rec.dispatched >= PATIENCE_MS / 1000 - SLEEP_EPS_S
        if rec.sent > rec.dispatched:
            row = rows[rec.plan.idx]
            assert not row["chunk_at"]
            assert rec.dispatched < row["read_at"] < row["left_at"]

    assert report["goodput_rps"] == round(want["success"] / 2.0, 4)
    assert report["offered_rps"] == 20.0
    assert report["slo_attainment"] == round(want["success"] / 40, 4)
    assert report["cost_per_success"] == pytest.approx(3.6 * 2 / 3600 / want["success"], rel=1e-3)


class Reads(httpx.AsyncByteStream):
    """A response body handed over in the given reads. ``windows[k]``: from just before
    read k was handed over to when the reader asked for the next one."""

    def __init__(self, reads: list[bytes]) -> None:
        self.reads = reads
        self.windows: list[tuple[float, float]] = []

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for data in self.reads:
            await asyncio.sleep(0.001)  # (the bounds hold at any pace; this only spaces them)
            handed = time.perf_counter()
            yield data
            self.windows.append((handed, time.perf_counter()))


def sse(content: str, completion_tokens: int) -> bytes:
    return b"data: " + json.dumps({
        "choices": [{"index": 0, "delta": {"content": content}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": completion_tokens,
                  "total_tokens": 9 + completion_tokens}}).encode() + b"\n\n"


async def test_each_event_is_stamped_when_its_bytes_are_handed_over() -> None:
    e0, e1, e2, e3 = sse(" a", 1), sse(" b c d", 4), sse(" e f g", 7), sse(" h i j", 10)
    done = (b'data: {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 10, '
            b'"total_tokens": 19}}\n\ndata: [DONE]\n\n')
    # e2 is split over reads 1 and 2: it arrived when its last byte did
    body = Reads([e0, e1 + e2[:10], e2[10:] + e3, done])

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=body)

    plan = Planned(idx=0, t=0.0, cls="a", input_tokens=1, output_tokens=10, tenant="t",
                   priority=None, patience_s=None, cancel_after=None, measured=True)
    rec = Record(plan=plan)
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        await send_one(client, "http://scripted/v1/chat/completions", None, b"{}", rec, 10.0)
    assert rec.finished and not rec.error and rec.status == 200
    assert [n for _, n in rec.events] == [1, 3, 3, 3]
    w = body.windows
    assert len(w) == 4
    for (stamp, _), read in zip(rec.events, [0, 1, 2, 2], strict=True):
        assert w[read][0] <= stamp <= w[read][1], (read, stamp, w[read])
    assert w[3][0] <= rec.done <= w[3][1]
    assert rec.sent <= w[0][0]
