"""`python -m loadtest.ceiling`: the open-loop search (bracket, then bisect) against a
scripted pass/fail, and the whole machinery in a tiny run against the fake upstream, checked
for consistency only (no figure depends on the machine's speed)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from loadtest import ceiling
from loadtest.ceiling import Plan, Probe, find_ceiling, open_ceiling, verdict
from loadtest.fake_upstream import FakeUpstream, start_fake_upstream
from loadtest.runner import CLIENT_CPU_LIMIT, LAG_P99_LIMIT_S


def threshold(limit: float, asked: list[float]) -> Callable[[float], Awaitable[Probe]]:
    """A client that keeps any rate up to ``limit`` and achieves 99 % of it."""

    async def measure(rate: float) -> Probe:
        asked.append(rate)
        ok = rate <= limit
        return Probe("open", rate, rate * 0.99, 0.001 if ok else 0.1, 0.5, not ok, int(rate))

    return measure


@pytest.mark.parametrize(("limit", "start"), [(730.0, 100.0), (40.0, 100.0), (100.0, 100.0)])
async def test_search_brackets_then_bisects_to_the_precision(limit: float, start: float
                                                             ) -> None:
    asked: list[float] = []
    plan = Plan(duration_s=1, start_rps=start, precision=0.05)
    probes = await find_ceiling(threshold(limit, asked), plan)
    assert [p.load for p in probes] == asked  # every probe is reported, in order
    passing = [p.load for p in probes if not p.unreliable]
    failing = [p.load for p in probes if p.unreliable]
    lo, hi = max(passing), min(failing)
    assert lo <= limit < hi
    assert hi / lo - 1 <= 0.05
    assert open_ceiling(probes) == pytest.approx(lo * 0.99)
    # bracketing doubles (or halves) from the start rate before it bisects
    assert asked[0] == start and asked[1] in (start * 2, start / 2)


async def test_search_stops_at_the_probe_budget_and_at_the_bounds() -> None:
    asked: list[float] = []
    probes = await find_ceiling(threshold(1e9, asked),
                                Plan(duration_s=1, start_rps=100, max_probes=3))
    assert asked == [100, 200, 400] and len(probes) == 3
    asked.clear()
    await find_ceiling(threshold(1e9, asked),
                       Plan(duration_s=1, start_rps=100, max_rps=300))
    assert asked == [100, 200, 300]  # passes at the cap: stops there
    asked.clear()
    probes = await find_ceiling(threshold(0.0, asked),
                                Plan(duration_s=1, start_rps=4, min_rps=1))
    assert asked == [4, 2, 1] and open_ceiling(probes) is None


def test_verdict_is_the_ratio_to_the_ceiling() -> None:
    closed = Probe("closed", 64, 95.0, 0.0, 1.0, True, 95)
    ratio, ok = verdict(100.0, closed)
    assert ratio == pytest.approx(0.95) and ok is True
    assert verdict(100.0, Probe("closed", 64, 80.0, 0.0, 1.0, True, 80))[1] is False
    # above the ceiling is no miss: the ceiling is taken at <= 85 % of a core
    assert verdict(100.0, Probe("closed", 64, 130.0, 0.0, 1.0, True, 130)) == (1.3, True)
    assert verdict(None, closed) == (None, None)
    assert verdict(100.0, None) == (None, None)


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    server = await start_fake_upstream("127.0.0.1", 0, chunks=3)
    yield server
    await server.close()


async def test_tiny_run_is_consistent(upstream: FakeUpstream,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    plan = Plan(duration_s=0.5, start_rps=10, max_probes=2, concurrencies=(2,), target_n=2)
    report = await ceiling.run_ceiling(upstream.base_url, plan)
    opened = [Probe(**p) for p in report["open"]]
    closed = [Probe(**p) for p in report["closed"]]
    assert len(opened) == 2 and [p.mode for p in opened] == ["open", "open"]
    assert opened[0].load == 10 and opened[1].load in (20, 5)
    assert [(p.mode, p.load) for p in closed] == [("closed", 2)]
    for p in opened + closed:
        # the run's own verdict is exactly its lag and CPU against the runner's limits
        assert p.unreliable == (p.lag_p99_s > LAG_P99_LIMIT_S or p.cpu_share > CLIENT_CPU_LIMIT)
        assert p.requests > 0
    assert report["limits"] == {"lag_p99_ms": LAG_P99_LIMIT_S * 1000,
                                "cpu_share": CLIENT_CPU_LIMIT}
    assert report["ceiling_rps"] == open_ceiling(opened)
    assert report["closed_target_rps"] == closed[0].achieved_rps
    ratio, ok = verdict(report["ceiling_rps"], closed[0])
    assert (report["ratio"], report["sustained"]) == (ratio, ok)
    out = capsys.readouterr().out
    assert ceiling.verdict_line(2, ratio, ok).strip() in out
    for p in opened + closed:
        assert ceiling.row(p) in out
