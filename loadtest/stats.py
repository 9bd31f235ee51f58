"""Per-request metrics and outcomes, exactly as docs/loadtest.md defines them.

Invariants: every arrival gets exactly one outcome (OUTCOMES); latencies are measured from
the moment the client sent the request; TPOT is (t_last - t_first)/(N_out - 1) and absent
for single-token answers; ITL gives every output token after the first one value, and a
chunk of n tokens that arrived g seconds after the previous one gives n values of g/n, so
sum(ITL) = t_last - t_first and mean(ITL) = TPOT. ICL (inter-chunk latency) gives every
content event after the first one value, the gap since the previous one, whatever its token
count: ITL and ICL agree only when every event carries one token.

Statistics (``describe``): n, mean, std, min, percentiles and max of a list of values. std
is the sample standard deviation (ddof=1; 0.0 for one value); percentiles are numpy's
linear interpolation; every figure but n is None when there are no values.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from loadtest.client import Record
from loadtest.workload import Slo

OUTCOMES = ("success", "slo_miss", "rejected_429", "rejected_503", "timeout", "error",
            "cancelled")
QUANTILES = {"p50": 50.0, "p95": 95.0, "p99": 99.0}
PERCENTILES = {"p50": 50.0, "p90": 90.0, "p95": 95.0, "p99": 99.0, "p99.9": 99.9}
STAT_KEYS = ("n", "mean", "std", "min", *PERCENTILES, "max")
# the latency metrics of every report block, in the order the report shows them
LATENCY_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "icl_ms", "e2e_ms", "queue_ms")


@dataclass(slots=True, frozen=True)
class Measured:
    """What one request's timeline says, in milliseconds."""

    ttft_ms: float | None
    tpot_ms: float | None
    itl_ms: tuple[float, ...]  # one per output token after the first
    icl_ms: tuple[float, ...]  # one per content event after the first
    e2e_ms: float | None
    queue_ms: float | None
    output_tokens: int
    prompt_tokens: int | None
    outcome: str
    slo_ok: dict[str, bool]  # per SLO of the class, for requests that completed
    tokens_estimated: bool  # tokens per chunk from text length, not running usage


def spread(total: int, weights: list[int]) -> list[int]:
    """Split ``total`` tokens over chunks in proportion to ``weights`` (largest remainder);
    each chunk with text gets at least one token when there are enough to go round."""
    if not weights:
        return []
    w = [max(1, x) for x in weights]
    if total >= len(w):
        base = [1] * len(w)
        left, wsum = total - len(w), sum(w)
        raw = [left * x / wsum for x in w]
    else:
        base, left, wsum = [0] * len(w), total, sum(w)
        raw = [total * x / wsum for x in w]
    floor = [int(r) for r in raw]
    order = sorted(range(len(w)), key=lambda i: raw[i] - floor[i], reverse=True)
    for i in order[: left - sum(floor)]:
        floor[i] += 1
    return [b + f for b, f in zip(base, floor)]


def token_events(rec: Record) -> tuple[list[tuple[float, int]], bool]:
    """(arrival time, tokens) per content event; True when tokens were estimated."""
    if all(n > 0 for _, n in rec.events):
        return rec.events, False
    total = rec.completion_tokens if rec.completion_tokens is not None else len(rec.events)
    counts = spread(total, rec.chars)
    return [(t, n) for (t, _), n in zip(rec.events, counts)], True


def itl_values(events: list[tuple[float, int]]) -> list[float]:
    """Seconds per token after the first, spreading each chunk's gap over its tokens."""
    out: list[float] = []
    seen = [(t, n) for t, n in events if n > 0]
    if not seen:
        return out
    out += [0.0] * (seen[0][1] - 1)  # tokens that came with the first one
    for (t0, _), (t1, n) in itertools.pairwise(seen):
        out += [(t1 - t0) / n] * n
    return out


def icl_values(events: list[tuple[float, int]]) -> list[float]:
    """Seconds between consecutive content events (those carrying >= 1 token)."""
    seen = [t for t, n in events if n > 0]
    return [t1 - t0 for t0, t1 in itertools.pairwise(seen)]


def classify(rec: Record, m_ttft: float | None, m_tpot: float | None, m_e2e: float | None,
             slo: Slo) -> tuple[str, dict[str, bool]]:
    if rec.cancelled:
        return "cancelled", {}
    if rec.status == 429:
        return "rejected_429", {}
    if rec.status == 503:
        return "rejected_503", {}
    if rec.timed_out or rec.status in (408, 504) or rec.error_status in (408, 504):
        return "timeout", {}  # incl. a gateway that cut the stream at the deadline
    if rec.status != 200 or rec.error or not rec.finished:
        return "error", {}
    ok: dict[str, bool] = {}
    if slo.ttft_ms is not None:
        ok["ttft"] = m_ttft is not None and m_ttft <= slo.ttft_ms
    if slo.tpot_ms is not None:
        ok["tpot"] = m_tpot is None or m_tpot <= slo.tpot_ms
    if slo.e2e_ms is not None:
        ok["e2e"] = m_e2e is not None and m_e2e <= slo.e2e_ms
    return ("success" if all(ok.values()) else "slo_miss"), ok


def measure(rec: Record, slo: Slo) -> Measured:
    events, estimated = token_events(rec)
    seen = [(t, n) for t, n in events if n > 0]
    n_out = rec.completion_tokens if rec.completion_tokens is not None \
        else sum(n for _, n in seen)
    ttft = (seen[0][0] - rec.sent) * 1000 if seen else None
    tpot = None
    if seen and n_out > 1:
        tpot = (seen[-1][0] - seen[0][0]) * 1000 / (n_out - 1)
    finished = rec.finished and not rec.cancelled and rec.status == 200
    e2e = (rec.done - rec.sent) * 1000 if finished else None
    outcome, ok = classify(rec, ttft, tpot, e2e, slo)
    return Measured(ttft, tpot if finished else None,
                    tuple(x * 1000 for x in itl_values(seen)) if finished else (),
                    tuple(x * 1000 for x in icl_values(seen)) if finished else (),
                    e2e, rec.queue_ms, n_out, rec.prompt_tokens, outcome, ok, estimated)


def quantiles(values: list[float]) -> dict[str, float | None]:
    """P50/P95/P99 alone (for callers that need no more than those)."""
    if not values:
        return {k: None for k in QUANTILES}
    arr = np.asarray(values, dtype=float)
    return {k: round(float(np.percentile(arr, q)), 3) for k, q in QUANTILES.items()}


def describe(values: list[float]) -> dict[str, float | int | None]:
    """{n, mean, std, min, p50, p90, p95, p99, p99.9, max}, rounded to 3 decimals."""
    if not values:
        return {"n": 0, **dict.fromkeys(STAT_KEYS[1:])}
    arr = np.asarray(values, dtype=float)
    std = float(np.std(arr, ddof=1)) if arr.size > 1 else 0.0
    out: dict[str, float | int | None] = {
        "n": int(arr.size), "mean": round(float(arr.mean()), 3), "std": round(std, 3),
        "min": round(float(arr.min()), 3)}
    pct = np.percentile(arr, list(PERCENTILES.values()))
    out.update((k, round(float(v), 3)) for k, v in zip(PERCENTILES, pct, strict=True))
    out["max"] = round(float(arr.max()), 3)
    return out


def latency_block(ms: list[Measured]) -> dict[str, dict[str, float | int | None]]:
    """``describe`` of TTFT, TPOT, ITL, ICL, E2E and queue time over ``ms``."""
    return {
        "ttft_ms": describe([m.ttft_ms for m in ms if m.ttft_ms is not None]),
        "tpot_ms": describe([m.tpot_ms for m in ms if m.tpot_ms is not None]),
        "itl_ms": describe([x for m in ms for x in m.itl_ms]),
        "icl_ms": describe([x for m in ms for x in m.icl_ms]),
        "e2e_ms": describe([m.e2e_ms for m in ms if m.e2e_ms is not None]),
        "queue_ms": describe([m.queue_ms for m in ms if m.queue_ms is not None]),
    }


def outcome_counts(ms: list[Measured]) -> dict[str, int]:
    counts = dict.fromkeys(OUTCOMES, 0)
    for m in ms:
        counts[m.outcome] += 1
    return counts
