"""The overhead bench's open-loop client, driven against an in-process fake upstream."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from loadtest.fake_upstream import FakeSettings, FakeUpstream
from loadtest.load_client import NOT_SENT, Pool, Sample, check_stream, closed_loop, open_loop
from loadtest.measure import (
    Stats,
    Target,
    chat_request,
    host_cpu,
    interleaved,
    percentile,
    steal_share,
)
from loadtest.overhead import pause_note


def test_percentile_interpolates_between_ranks() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.5
    assert percentile(values, 99) == 99.01
    assert percentile([3.0], 99) == 3.0


def _stream(*payloads: bytes) -> bytes:
    return b"".join(b"data: " + p + b"\n\n" for p in payloads)


def test_check_stream_counts_content_chunks_and_wants_done() -> None:
    chunk = b'{"choices":[{"delta":{"content":"x"}}]}'
    role = b'{"choices":[{"delta":{"role":"assistant","content":""}}]}'
    usage = b'{"choices":[],"usage":{"completion_tokens":2}}'
    good = Sample(due=0, status=200, body=_stream(role, chunk, chunk, usage, b"[DONE]"))
    assert check_stream(good, 2) == ""
    assert check_stream(good, 3) == "2 content chunks"
    crlf = Sample(due=0, status=200, body=good.body.replace(b"\n", b"\r\n"))
    assert check_stream(crlf, 2) == ""
    assert check_stream(Sample(due=0, status=200, body=_stream(chunk)), 1) == "no [DONE]"
    assert check_stream(Sample(due=0, status=401), 1) == "HTTP 401"
    assert check_stream(Sample(due=0, error="timeout"), 1) == "timeout"


async def test_open_loop_sends_the_schedule_on_kept_alive_connections() -> None:
    async with FakeUpstream(settings=FakeSettings(chunks=5)) as up:
        pool = Pool("127.0.0.1", up.port, chat_request(up.port, "sk-x"))
        await pool.warm(4)
        samples = await open_loop(pool, rate=200, seconds=0.25)
        assert len(samples) == 50
        assert all(check_stream(s, 5) == "" for s in samples)
        # open_loop sends what is due within half a millisecond together, so a request may
        # leave up to 0.5 ms before its due time, never earlier
        assert all(s.sent >= s.due - 0.0005 for s in samples), [
            s.sent - s.due for s in samples]
        assert all(s.sent < s.first <= s.done for s in samples)
        assert pool.opened == 4 and pool.connecting == 0  # warm connections were enough
        await pool.close()


async def test_an_overloaded_target_gets_the_rest_of_its_schedule_as_not_sent() -> None:
    # 50 chunks 20 ms apart: each answer takes a second, so requests pile up in flight.
    async with FakeUpstream(settings=FakeSettings(chunks=50, delay_ms=20)) as up:
        pool = Pool("127.0.0.1", up.port, chat_request(up.port, None))
        samples = await open_loop(pool, rate=100, seconds=0.5, max_in_flight=10)
        assert len(samples) == 50
        unsent = [s for s in samples if s.error == NOT_SENT]
        assert len(unsent) == 39  # the 12th request finds 11 in flight
        assert all(check_stream(s, 50) == "" for s in samples if s.error != NOT_SENT)
        await pool.close()


async def test_interleaved_measures_each_target_alike() -> None:
    async with FakeUpstream(settings=FakeSettings(chunks=20)) as up:
        targets = [Target(name, Pool("127.0.0.1", up.port, chat_request(up.port, None)))
                   for name in ("a", "b")]
        stats = await interleaved(targets, rate=100, seconds=0.4, segment_s=0.1, chunks=20)
        for target in targets:
            await target.pool.close()
    assert set(stats) == {"a", "b"}
    for s in stats.values():
        assert isinstance(s, Stats)
        assert s.n == 40 and s.errors == 0
        assert 0 < s.ttft_p50_ms <= s.e2e_p50_ms <= s.e2e_p99_ms
        # each segment's stolen share of the machine's CPU time, where /proc/stat says it
        assert len(s.segment_steal) == 4
        if Path("/proc/stat").exists():
            assert all(0 <= v <= 1 for v in s.segment_steal)


async def test_closed_loop_keeps_a_fixed_number_of_requests_in_flight() -> None:
    # each answer takes ~50 ms (5 chunks 10 ms apart): 4 clients for 0.3 s make about 4 x 6
    # requests, never more than 4 at once, all on the 4 warm connections
    async with FakeUpstream(settings=FakeSettings(chunks=5, delay_ms=10)) as up:
        pool = Pool("127.0.0.1", up.port, chat_request(up.port, None))
        samples, span = await closed_loop(pool, concurrency=4, seconds=0.3)
        assert pool.refill is None and pool.in_flight == 0
        assert all(check_stream(s, 5) == "" for s in samples)
        assert 12 <= len(samples) <= 32
        assert 0.3 <= span < 1.0
        events = sorted([(s.sent, 1) for s in samples] + [(s.done, -1) for s in samples])
        in_flight = peak = 0
        for _, step in events:
            in_flight += step
            peak = max(peak, in_flight)
        assert peak == 4
        # each client sent its next request right after its previous one ended
        assert sum(1 for s in samples if s.due == s.sent or s.sent - s.due < 0.005) == len(samples)
        assert pool.opened == 4
        await pool.close()


async def test_saturation_reports_rates_and_ratios_per_round() -> None:
    from loadtest.tracing_cost import saturation

    async with FakeUpstream(settings=FakeSettings(chunks=20)) as up:
        targets = [Target(name, Pool("127.0.0.1", up.port, chat_request(up.port, None)))
                   for name in ("base", "other")]
        out = await saturation(targets, rounds=2, segment_s=0.2, clients=2)
        for target in targets:
            await target.pool.close()
    assert [len(out["rates"][n]) for n in ("base", "other")] == [2, 2]
    assert out["errors"] == {"base": {}, "other": {}}
    assert all(r > 0 for r in out["rates"]["base"] + out["rates"]["other"])
    assert out["ratios"]["other"] == [round(a / b, 4) for a, b in
                                      zip(out["rates"]["other"], out["rates"]["base"])]
    assert out["median_ratio"]["other"] > 0


def test_steal_share_is_stolen_over_all_cpu_time() -> None:
    assert steal_share((100, 10_000), (150, 11_000)) == 0.05
    assert math.isnan(steal_share(None, (150, 11_000)))
    assert math.isnan(steal_share((100, 10_000), (100, 10_000)))  # no time passed
    if Path("/proc/stat").exists():
        now = host_cpu()
        assert now is not None and 0 <= now[0] <= now[1]


PAUSES = {"gc_long_pauses_total": 0.0, "gc_pause_seconds_total": 0.001,
          "loop_stalls_total": 0.0, "loop_stall_seconds_total": 0.0,
          "renew_beats_total": 1.0, "renew_beat_seconds_total": 0.002}


@pytest.mark.parametrize("steal", [[0.0, 0.3, 0.0], None])
def test_the_pause_note_names_the_worst_segment_and_its_steal(
        steal: list[float] | None) -> None:
    stalled = dict(PAUSES, loop_stalls_total=2.0, loop_stall_seconds_total=0.04)
    note = pause_note([3.0, 60.0, 4.0], [PAUSES, stalled, PAUSES], steal)
    everything, worst = note.split("; in the worst ")
    assert "2 loop stalls >= 5 ms (40.0 ms)" in everything
    assert worst.startswith("(#2, p99 60.00 ms) 0 collector passes")
    assert "2 loop stalls >= 5 ms (40.0 ms), 1 renewal beats (2.0 ms)" in worst
    if steal is None:  # unknown: not printed
        assert "steal" not in note
    else:
        assert worst.endswith("host steal 30.0%") and "host steal 10.0%" in everything
