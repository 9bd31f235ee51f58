"""Workload files and arrival schedules: validation names the bad field; every process gives
its configured mean rate within 5% over a long seeded draw; the same seed gives the same
schedule, and a different seed a different one."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from loadtest.arrivals import Planned, arrival_times, schedule
from loadtest.client import Record
from loadtest.stats import itl_values, measure, spread
from loadtest.workload import Slo, WorkloadError, load_workload, parse_workload

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO_ROOT / "configs" / "workloads").glob("*.yaml"))
LONG_S = 4000.0


def spec(arrival: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"seed": 11, "duration_s": LONG_S, "arrival": arrival,
            "classes": [{"name": "a", "share": 3, "lengths": {"pairs": [[10, 5], [20, 8]]},
                         "cancel": {"share": 0.1, "patience_ms": {"median": 500}}},
                        {"name": "b", "share": 1,
                         "lengths": {"buckets": [{"input": 64, "output": 16}]}}],
            **extra}


PROCESSES = {
    "constant": {"process": "constant", "rate": 5},
    "poisson": {"process": "poisson", "rate": 5},
    "gamma": {"process": "gamma", "rate": 5, "shape": 0.25},
    "piecewise": {"process": "piecewise", "pieces": [{"until_s": 1000, "rate": 2},
                                                     {"until_s": 3000, "rate": 8}]},
    "diurnal": {"process": "diurnal", "rate": 5, "period_s": 400, "amplitude": 0.8},
}


@pytest.mark.parametrize("name", sorted(PROCESSES))
def test_mean_rate_and_determinism(name: str) -> None:
    w = parse_workload(spec(PROCESSES[name]))
    times = arrival_times(w)
    assert times == sorted(times) and 0 <= times[0] and times[-1] < LONG_S
    rate = len(times) / LONG_S
    assert abs(rate - w.mean_rate()) <= 0.05 * w.mean_rate(), (rate, w.mean_rate())
    assert w.arrival.rate == pytest.approx(w.mean_rate())
    assert schedule(w) == schedule(parse_workload(spec(PROCESSES[name])))
    other = parse_workload({**spec(PROCESSES[name]), "seed": 12})
    if name != "constant":
        assert arrival_times(other) != times


def test_piecewise_mean_and_rate_per_piece() -> None:
    w = parse_workload(spec(PROCESSES["piecewise"]))
    # 1000 s at 2, 2000 s at 8, the last 1000 s at the last rate (8)
    assert w.mean_rate() == pytest.approx((2 * 1000 + 8 * 3000) / LONG_S)
    times = arrival_times(w)
    first = sum(t < 1000 for t in times) / 1000
    assert abs(first - 2) <= 0.1 * 2


def test_gamma_is_burstier_than_poisson() -> None:
    def cv2(name: str) -> float:
        t = arrival_times(parse_workload(spec(PROCESSES[name])))
        gaps = [b - a for a, b in itertools.pairwise(t)]
        mean = sum(gaps) / len(gaps)
        return sum((g - mean) ** 2 for g in gaps) / len(gaps) / mean**2

    assert abs(cv2("poisson") - 1) < 0.15
    assert abs(cv2("gamma") - 4) < 0.8  # CV^2 = 1 / shape


def test_classes_lengths_and_cancels_follow_the_spec() -> None:
    w = parse_workload(spec(PROCESSES["poisson"]))
    plan = schedule(w)
    share_a = sum(p.cls == "a" for p in plan) / len(plan)
    assert abs(share_a - 0.75) < 0.03
    assert {(p.input_tokens, p.output_tokens) for p in plan if p.cls == "a"} == {(10, 5),
                                                                                (20, 8)}
    assert {(p.input_tokens, p.output_tokens) for p in plan if p.cls == "b"} == {(64, 16)}
    cancels = [p for p in plan if p.patience_s is not None]
    assert all(p.cls == "a" for p in cancels)
    assert abs(len(cancels) / share_a / len(plan) - 0.1) < 0.02
    median = sorted(p.patience_s or 0 for p in cancels)[len(cancels) // 2]
    assert abs(median - 0.5) < 0.05


def test_same_class_draws_whatever_the_rate() -> None:
    w = parse_workload(spec(PROCESSES["poisson"]))
    slow, fast = schedule(w), schedule(w.scaled(2.0))
    assert len(fast) > 1.8 * len(slow)
    assert [p.cls for p in slow] == [p.cls for p in fast[: len(slow)]]


def test_replay(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"t": 0.5, "input": 10, "output": 3, "class": "b", "tenant": "x"}\n'
                     '{"t": 0.1, "input": 7, "output": 2, "priority": 4}\n')
    (tmp_path / "w.yaml").write_text(
        "duration_s: 2\narrival: {process: replay, trace: t.jsonl}\n"
        "classes:\n  - {name: a, share: 1, lengths: {pairs: [[1, 1]]}}\n"
        "  - {name: b, share: 1, lengths: {pairs: [[1, 1]]}}\n")
    w = load_workload(tmp_path / "w.yaml")
    plan = schedule(w)
    assert [(p.t, p.input_tokens, p.output_tokens) for p in plan] == [(0.1, 7, 2), (0.5, 10, 3)]
    assert plan[0].priority == 4 and plan[1].cls == "b" and plan[1].tenant == "x"
    assert w.arrival.rate == pytest.approx(1.0)


@pytest.mark.parametrize(("patch", "field"), [
    ({"arrival": {"process": "gamma", "rate": 3}}, "arrival.shape"),
    ({"arrival": {"process": "poisson", "rate": -1}}, "arrival.rate"),
    ({"classes": [{"name": "a", "share": 1, "lengths": {}}]}, "classes.0.lengths"),
    ({"classes": [{"name": "a", "share": 1, "lengths": {"pairs": [[1, 1]]},
                   "slo": {"ttft": 5}}]}, "classes.0.slo.ttft"),
    ({"classes": [{"name": "a", "share": 1, "lengths": {"pairs": [[1, 1]]},
                   "prefix_group": "nope"}]}, "prefix_group"),
    ({"warmup_s": LONG_S}, "warmup_s"),
])
def test_errors_name_the_field(patch: dict[str, Any], field: str) -> None:
    with pytest.raises(WorkloadError, match=field.replace(".", r"\.")):
        parse_workload({**spec(PROCESSES["poisson"]), **patch})


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_load(path: Path) -> None:
    w = load_workload(path)
    assert schedule(w) and w.mean_rate() > 0
    assert all(c.length_pairs() for c in w.classes)


def test_examples_exist() -> None:
    assert {p.name for p in EXAMPLES} >= {"smoke.yaml", "mixed.yaml", "burst.yaml",
                                          "prefix.yaml"}


def test_tokens_spread_over_chunks_and_itl() -> None:
    assert spread(7, [4, 4, 4]) == [3, 2, 2] or sorted(spread(7, [4, 4, 4])) == [2, 2, 3]
    assert sum(spread(10, [1, 9])) == 10 and spread(10, [1, 9])[1] > spread(10, [1, 9])[0]
    # a chunk of 3 tokens 0.03 s after the first token: three ITLs of 0.01 s
    assert itl_values([(1.0, 1), (1.03, 3)]) == pytest.approx([0.01] * 3)
    # two tokens in the first chunk: the second one came with the first (gap 0)
    assert itl_values([(1.0, 2), (1.02, 1)]) == pytest.approx([0.0, 0.02])


def _record(**kw: Any) -> Record:
    plan = Planned(idx=0, t=0.0, cls="a", input_tokens=1, output_tokens=3, tenant="t",
                   priority=None, patience_s=None, cancel_after=None, measured=True)
    rec = Record(plan=plan, sent=1.0, done=1.5, status=200, finished=True,
                 events=[(1.1, 1), (1.2, 2)], chars=[1, 2], completion_tokens=3)
    for k, v in kw.items():
        setattr(rec, k, v)
    return rec


@pytest.mark.parametrize(("changes", "outcome"), [
    ({}, "success"),
    ({"status": 429, "events": [], "chars": []}, "rejected_429"),
    ({"status": 503, "events": [], "chars": []}, "rejected_503"),
    ({"status": 504, "events": [], "chars": []}, "timeout"),
    # the gateway cut the stream at the deadline: an error event with status 504
    ({"error": "in-stream error: deadline", "error_status": 504}, "timeout"),
    ({"error": "in-stream error: upstream died", "error_status": 502}, "error"),
    ({"finished": False}, "error"),
    ({"timed_out": True, "finished": False}, "timeout"),
    ({"cancelled": "patience", "events": [], "chars": []}, "cancelled"),
    ({"done": 3.0}, "slo_miss"),  # E2E 2000 ms > 1000
])
def test_every_request_gets_one_outcome(changes: dict[str, Any], outcome: str) -> None:
    m = measure(_record(**changes), Slo(ttft_ms=500, e2e_ms=1000))
    assert m.outcome == outcome
    if outcome == "success":
        assert m.ttft_ms == pytest.approx(100) and m.tpot_ms == pytest.approx(50)
        assert m.itl_ms == pytest.approx((50.0, 50.0)) and m.e2e_ms == pytest.approx(500)


def test_tokens_estimated_without_running_usage() -> None:
    m = measure(_record(events=[(1.1, -1), (1.2, -1)], chars=[1, 8], completion_tokens=5),
                Slo())
    assert m.tokens_estimated and m.output_tokens == 5 and len(m.itl_ms) == 4


def test_a_prefix_group_with_a_count_spreads_requests_over_that_many_prefixes() -> None:
    from collections import Counter

    from loadtest.prompts import Calibration, PromptBook, hash_name, words

    cal = Calibration(per_word=1.0, overhead=0.0)
    many = PromptBook(cal, 7, {"docs": 50}, salt=1, counts={"docs": 4})
    heads = [many.text(i, 80, "docs").split("\n", 1)[0] for i in range(400)]
    seen = Counter(heads)
    assert len(seen) == 4 and all(len(h.split()) == 50 for h in seen)
    assert min(seen.values()) >= 60  # uniform-ish: 100 each expected
    # the same request starts with the same prefix in every run (only the body is salted)
    other_run = PromptBook(cal, 7, {"docs": 50}, salt=2, counts={"docs": 4})
    assert [other_run.text(i, 80, "docs").split("\n", 1)[0] for i in range(400)] == heads
    # count 1 (the default) keeps the single prefix a group always had, which is also the
    # first of the group's variants
    one = PromptBook(cal, 7, {"docs": 50}, salt=1)
    (single,) = {one.text(i, 80, "docs").split("\n", 1)[0] for i in range(50)}
    assert single == words(hash_name("docs", 7), 50)
    assert single in seen
