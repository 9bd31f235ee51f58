"""Per-request metrics and their statistics, against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from loadtest.arrivals import Planned
from loadtest.client import CANCEL_TOKENS, Record
from loadtest.stats import (
    LATENCY_KEYS,
    STAT_KEYS,
    describe,
    icl_values,
    itl_values,
    latency_block,
    measure,
    quantiles,
)
from loadtest.workload import Slo

SLO = Slo(ttft_ms=1000, tpot_ms=1000, e2e_ms=10_000)


def record(events: list[tuple[float, int]], *, sent: float = 0.9, done: float = 2.0,
           finished: bool = True, cancelled: str = "") -> Record:
    plan = Planned(idx=0, t=0.0, cls="c", input_tokens=10, output_tokens=7, tenant="t",
                   priority=None, patience_s=None, cancel_after=None, measured=True)
    return Record(plan=plan, sent=sent, done=done, status=200, events=events,
                  completion_tokens=sum(n for _, n in events), prompt_tokens=10,
                  finished=finished, cancelled=cancelled)


def test_describe_matches_hand_computed_values() -> None:
    d = describe([1.0, 2.0, 3.0, 4.0, 100.0])
    assert tuple(d) == STAT_KEYS
    assert STAT_KEYS == ("n", "mean", "std", "min", "p50", "p90", "p95", "p99", "p99.9",
                         "max")
    # sample std: squared deviations from 22 are 441+400+361+324+6084 = 7610, over n-1 = 4
    assert d["n"] == 5 and d["mean"] == 22.0
    assert d["std"] == round(math.sqrt(7610 / 4), 3)
    assert d["min"] == 1.0 and d["max"] == 100.0
    # linear interpolation between order statistics: rank q/100 * (n-1), here 4 + f * 96
    assert d["p50"] == 3.0
    assert d["p90"] == pytest.approx(4 + 0.6 * 96)
    assert d["p95"] == pytest.approx(4 + 0.8 * 96)
    assert d["p99"] == pytest.approx(4 + 0.96 * 96)
    assert d["p99.9"] == pytest.approx(4 + 0.996 * 96)


def test_describe_one_value_and_none() -> None:
    one = describe([7.5])
    assert one["n"] == 1 and one["std"] == 0.0
    assert all(one[k] == 7.5 for k in STAT_KEYS if k not in ("n", "std"))
    empty = describe([])
    assert empty["n"] == 0 and tuple(empty) == STAT_KEYS
    assert all(empty[k] is None for k in STAT_KEYS[1:])


def test_quantiles_keeps_its_three_keys() -> None:
    assert quantiles([1.0, 2.0, 3.0]) == {"p50": 2.0, "p95": 2.9, "p99": 2.98}
    assert quantiles([]) == {"p50": None, "p95": None, "p99": None}


def test_icl_is_per_event_and_itl_per_token() -> None:
    # chunks of 1, 3 and 3 tokens at 1.0, 1.3 and 1.9 s; sent at 0.9 s
    rec = record([(1.0, 1), (1.3, 3), (1.9, 3)])
    m = measure(rec, SLO)
    assert m.icl_ms == pytest.approx((300.0, 600.0))
    assert m.itl_ms == pytest.approx((100.0,) * 3 + (200.0,) * 3)
    # ITL still sums to t_last - t_first and averages to TPOT; ICL does not
    assert sum(m.itl_ms) == pytest.approx(900.0)
    assert m.tpot_ms == pytest.approx(150.0)
    assert sum(m.itl_ms) / len(m.itl_ms) == pytest.approx(m.tpot_ms)
    assert m.ttft_ms == pytest.approx(100.0)


def test_icl_skips_empty_events_and_extra_first_tokens() -> None:
    events = [(1.0, 2), (1.1, 0), (1.5, 1)]  # a role-only event carries no token
    assert icl_values(events) == pytest.approx([0.5])
    assert itl_values(events) == pytest.approx([0.0, 0.5])
    m = measure(record([(1.0, 2), (1.5, 1)]), SLO)
    assert m.icl_ms == pytest.approx((500.0,))
    assert m.itl_ms == pytest.approx((0.0, 500.0))
    # one token per event: the two definitions agree
    same = measure(record([(1.0, 1), (1.2, 1), (1.5, 1)]), SLO)
    assert same.icl_ms == pytest.approx((200.0, 300.0))
    assert same.itl_ms == pytest.approx((200.0, 300.0))


def test_icl_only_for_completed_answers() -> None:
    m = measure(record([(1.0, 1), (1.3, 3)], finished=False, cancelled=CANCEL_TOKENS),
                SLO)
    assert m.outcome == "cancelled" and m.icl_ms == () and m.itl_ms == ()


def test_latency_block_describes_every_metric() -> None:
    ms = [measure(record([(1.0, 1), (1.3, 3), (1.9, 3)]), SLO),
          measure(record([(1.0, 1), (1.2, 1)], done=1.4), SLO)]
    block = latency_block(ms)
    assert tuple(block) == LATENCY_KEYS
    assert LATENCY_KEYS.index("icl_ms") == LATENCY_KEYS.index("itl_ms") + 1
    for stats in block.values():
        assert tuple(stats) == STAT_KEYS
    icl = block["icl_ms"]
    assert icl["n"] == 3 and icl["min"] == 200.0 and icl["max"] == 600.0
    assert icl["mean"] == pytest.approx(1100 / 3, abs=1e-3)
    assert block["itl_ms"]["n"] == 7
    assert block["queue_ms"] == describe([])  # no request carried the header
    assert block["e2e_ms"]["p50"] == pytest.approx(800.0)
