"""From measured requests to the report: rates, goodput, attainment, cost, breakdowns.

The denominator is honest: every arrival scheduled inside the measured window counts,
whatever became of it (rejected, timed out, abandoned). Rates divide by the window's
length in schedule time, so offered_rps is exactly what the workload asked for.

``report.json`` holds exactly the keys the issue fixes (REPORT_KEYS); everything else the
report shows (per tenant, per priority, per SLO, overall latencies, the timeline, the
sweep curve, throughput, the prompt-sizing error) goes to ``details.json``.

Prompt sizing is checked, not assumed: a server whose reported ``prompt_tokens`` stray
more than CALIBRATION_LIMIT_PCT on average from what each prompt was sized for (say, one
that reports a constant) gets a "prompt sizing unreliable" note. That says nothing about
whether the client kept the schedule, so it leaves ``unreliable`` alone.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from loadtest.client import Record
from loadtest.runner import RunResult, lag_p99
from loadtest.stats import OUTCOMES, Measured, latency_block, measure, outcome_counts
from loadtest.workload import Workload

REPORT_KEYS = ("offered_rps", "achieved_rps", "goodput_rps", "slo_attainment", "duration_s",
               "outcomes", "classes", "cost_per_success", "capacity_rps", "unreliable",
               "partial", "notes")
CLASS_KEYS = ("count", "goodput_rps", "slo_attainment", "ttft_ms", "tpot_ms", "itl_ms",
              "icl_ms", "e2e_ms", "queue_ms")
SERVED = ("success", "slo_miss")
CALIBRATION_LIMIT_PCT = 10.0  # mean |prompt_tokens - planned| / planned past this: flagged
CALIBRATION_NOTE = "prompt sizing unreliable:"


def _rate(n: int, window_s: float) -> float:
    return round(n / window_s, 4)


def _attain(ms: list[Measured]) -> float | None:
    return round(sum(m.outcome == "success" for m in ms) / len(ms), 4) if ms else None


def _group(ms: list[Measured], window_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {
        "count": len(ms),
        "goodput_rps": _rate(sum(m.outcome == "success" for m in ms), window_s),
        "slo_attainment": _attain(ms)}
    out.update(latency_block(ms))
    return out


def cost_per_success(w: Workload, ms: list[Measured], window_s: float) -> float | None:
    """Dollars per successful request over the window (machine time and/or tokens)."""
    if w.cost is None:
        return None
    wins = sum(m.outcome == "success" for m in ms)
    if not wins:
        return None
    total = 0.0
    if w.cost.machine_hour_usd is not None:
        total += w.cost.machine_hour_usd * window_s / 3600
    if w.cost.input_per_mtok_usd is not None:
        total += w.cost.input_per_mtok_usd * sum(m.prompt_tokens or 0 for m in ms) / 1e6
    if w.cost.output_per_mtok_usd is not None:
        # every generated token is paid for, including those of failed or abandoned requests
        total += w.cost.output_per_mtok_usd * sum(m.output_tokens for m in ms) / 1e6
    return round(total / wins, 8)


def per_slo(ms: list[Measured]) -> dict[str, float | None]:
    """Attainment of each SLO alone, over the requests that completed: the binding one is
    the lowest."""
    hits: dict[str, list[bool]] = defaultdict(list)
    for m in ms:
        for name, ok in m.slo_ok.items():
            hits[name].append(ok)
    return {name: round(sum(v) / len(v), 4) for name, v in sorted(hits.items())}


def calibration_error(records: list[Record], ms: list[Measured]) -> dict[str, Any]:
    """How far the prompts the server counted were from the sizes planned, in % of the
    planned size, over the requests whose server reported ``prompt_tokens``."""
    errs = [abs(m.prompt_tokens - r.plan.input_tokens) / r.plan.input_tokens * 100
            for r, m in zip(records, ms, strict=True)
            if m.prompt_tokens is not None and r.plan.input_tokens > 0]
    if not errs:
        return {"mean_abs_pct": None, "p90_abs_pct": None, "max_abs_pct": None, "n": 0}
    arr = np.asarray(errs)
    return {"mean_abs_pct": round(float(arr.mean()), 2),
            "p90_abs_pct": round(float(np.percentile(arr, 90)), 2),
            "max_abs_pct": round(float(arr.max()), 2), "n": len(errs)}


def calibration_note(err: dict[str, Any]) -> str | None:
    """The report note when prompt sizing was off by more than CALIBRATION_LIMIT_PCT."""
    mean = err["mean_abs_pct"]
    if mean is None or mean <= CALIBRATION_LIMIT_PCT:
        return None
    return (f"{CALIBRATION_NOTE} prompts were off by {mean:.1f}% on average from the "
            f"requested input tokens (p90 {err['p90_abs_pct']:.1f}%, max "
            f"{err['max_abs_pct']:.1f}% over {err['n']} requests); the target's reported "
            f"prompt_tokens do not follow the prompts sent")


def timeline(records: list[Record], ms: list[Measured], start: float, wall_s: float,
             ) -> list[dict[str, float]]:
    """Per second of the run: sent, served, succeeded, rejected, abandoned."""
    n = max(1, int(wall_s) + 1)
    rows = [{"t": float(i), "sent": 0.0, "served": 0.0, "success": 0.0, "rejected": 0.0,
             "cancelled": 0.0, "other": 0.0} for i in range(n)]
    for rec, m in zip(records, ms):
        if rec.sent:
            rows[min(n - 1, max(0, int(rec.sent - start)))]["sent"] += 1
        i = min(n - 1, max(0, int((rec.done or rec.sent) - start)))
        key = {"success": "success", "slo_miss": "served", "rejected_429": "rejected",
               "rejected_503": "rejected", "cancelled": "cancelled"}.get(m.outcome, "other")
        rows[i][key] += 1
        if m.outcome == "success":
            rows[i]["served"] += 1
    return rows


def summarize(w: Workload, result: RunResult, capacity_rps: float | None = None,
              ) -> tuple[dict[str, Any], dict[str, Any], list[Measured]]:
    """(report.json, details.json, per-request metrics in record order)."""
    ms = [measure(r, w.class_named(r.plan.cls).slo) for r in result.records]
    win_recs = [r for r in result.records if r.plan.measured]
    win = [m for r, m in zip(result.records, ms) if r.plan.measured]
    w0, w1 = w.window()
    window_s = w1 - w0
    counts = outcome_counts(win)
    notes = list(result.notes)
    if any(m.tokens_estimated for m in win):
        notes.append("tokens per chunk estimated from text length (the target sent no "
                     "running usage)")
    cal_err = calibration_error(win_recs, win)
    cal_note = calibration_note(cal_err)
    if cal_note is not None:
        notes.append(cal_note)
    report: dict[str, Any] = {
        "offered_rps": _rate(len(win), window_s),
        "achieved_rps": _rate(sum(counts[k] for k in SERVED), window_s),
        "goodput_rps": _rate(counts["success"], window_s),
        "slo_attainment": _attain(win),
        "duration_s": round(window_s, 3),
        "outcomes": counts,
        "classes": {},
        "cost_per_success": cost_per_success(w, win, window_s),
        "capacity_rps": capacity_rps,
        "unreliable": any(n.startswith("unreliable") for n in notes),
        "partial": False,  # the command sets it for a run cut short
        "notes": notes,
    }
    by_class: dict[str, list[Measured]] = defaultdict(list)
    by_tenant: dict[str, list[Measured]] = defaultdict(list)
    by_prio: dict[str, list[Measured]] = defaultdict(list)
    for r, m in zip(result.records, ms):
        if r.plan.measured:
            by_class[r.plan.cls].append(m)
            by_tenant[r.plan.tenant].append(m)
            by_prio[str(r.plan.priority)].append(m)
    for c in w.classes:
        report["classes"][c.name] = _group(by_class.get(c.name, []), window_s)

    def breakdown(groups: dict[str, list[Measured]]) -> dict[str, Any]:
        return {k: {**_group(v, window_s), "outcomes": outcome_counts(v)}
                for k, v in sorted(groups.items())}

    served = [m for m in win if m.outcome in SERVED]
    details: dict[str, Any] = {
        "workload": w.name, "seed": w.seed, "mean_rate": w.mean_rate(),
        "arrivals": len(result.records), "measured": len(win),
        "overall": latency_block(win),
        "throughput": {"output_tokens_per_s": round(sum(m.output_tokens for m in served)
                                                    / window_s, 3),
                       "requests_per_s": report["achieved_rps"]},
        "calibration_error": cal_err,
        "calibration_unreliable": cal_note is not None,
        "output_tokens": {"mean": round(sum(m.output_tokens for m in served)
                                        / max(1, len(served)), 2)},
        "prompt_tokens": {"mean": round(sum(m.prompt_tokens or 0 for m in served)
                                        / max(1, len(served)), 2)},
        "slo_attainment_by_slo": per_slo(served),
        "class_slo_attainment_by_slo": {k: per_slo([m for m in v if m.outcome in SERVED])
                                        for k, v in sorted(by_class.items())},
        "class_outcomes": {k: outcome_counts(v) for k, v in sorted(by_class.items())},
        "tenants": breakdown(by_tenant),
        "priorities": breakdown(by_prio),
        "client": {"cpu_share": round(result.client_cpu, 3),
                   "dispatch_lag_p99_ms": round(lag_p99(result.records) * 1000, 3),
                   "wall_s": round(result.wall_s, 3)},
        "timeline": timeline(result.records, ms, result.start, result.wall_s),
        "scraped": [{"t": round(s.t, 3), "url": s.url, **s.values} for s in result.scraped],
        "outcome_names": list(OUTCOMES),
    }
    return report, details, ms
