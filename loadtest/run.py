"""One measured run of a workload against a target, start to finish.

calibrate prompts on the target -> draw the schedule -> send it open loop (progress bar,
/metrics scraping) -> per-request metrics -> the report dicts. `sluice loadtest`, the
sweep and `make capacity` all go through `measure_workload`.
"""

from __future__ import annotations

import collections
import secrets
from dataclasses import dataclass, field
from typing import Any

from loadtest.arrivals import schedule
from loadtest.client import Record, Target, calibrate
from loadtest.prompts import Calibration, PromptBook
from loadtest.runner import RunResult, run_schedule
from loadtest.stats import Measured
from loadtest.summary import summarize
from loadtest.workload import Workload


@dataclass(slots=True)
class Measurement:
    report: dict[str, Any]
    details: dict[str, Any]
    measured: list[Measured]
    result: RunResult
    calibration: Calibration
    sweep: list[dict[str, Any]] = field(default_factory=list)


def _progress(total: int, label: str) -> tuple[Any, Any]:
    """A rich progress bar (on stderr) and the per-request callback that advances it."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[tally]}"), TimeElapsedColumn(), transient=False)
    task = bar.add_task(label, total=total, tally="")
    tally: collections.Counter[str] = collections.Counter()

    def done(rec: Record) -> None:
        if rec.cancelled:
            tally["cancelled"] += 1
        elif rec.status == 200 and rec.finished:
            tally["done"] += 1
        elif rec.status in (429, 503):
            tally[str(rec.status)] += 1
        else:
            tally["failed"] += 1
        bar.update(task, advance=1, tally=" ".join(f"{k}={v}" for k, v in sorted(tally.items())))

    return bar, done


async def measure_workload(w: Workload, base_url: str, key: str | None, *,
                           timeout_s: float = 60.0, scrape: list[str] | None = None,
                           progress: bool = True, label: str = "",
                           calibration: tuple[Calibration, bool] | None = None,
                           capacity_rps: float | None = None,
                           prompt_salt: int | None = None,
                           scrape_key: str | None = None) -> Measurement:
    """Run ``w`` once against ``base_url``. Prompts are new for every run (a random salt)
    unless ``prompt_salt`` pins them. ``scrape_key`` is the bearer key sent to the
    ``scrape`` URLs (a bundled backend's /metrics needs its API key), not to the target."""
    base_url = base_url.rstrip("/").removesuffix("/v1")
    cal, continuous = calibration or await calibrate(base_url, key, w)
    target = Target(base_url, key, timeout_s, continuous)
    plan = schedule(w)
    salt = secrets.randbits(48) if prompt_salt is None else prompt_salt
    prompts = PromptBook(cal, w.seed, {g.name: g.tokens for g in w.prefix_groups}, salt,
                         {g.name: g.count for g in w.prefix_groups})
    keys = {c.name: c.api_key(key) for c in w.classes}
    urls = [base_url] + [u for u in scrape or [] if u.rstrip("/") != base_url]
    scrape_keys = {u: scrape_key for u in scrape or []} if scrape_key else None
    if progress:
        bar, done = _progress(len(plan), label or f"{w.name} @ {w.mean_rate():.3g} rps")
        with bar:
            result = await run_schedule(w, plan, target, prompts, keys, urls, done,
                                        scrape_keys=scrape_keys)
    else:
        result = await run_schedule(w, plan, target, prompts, keys, urls,
                                    scrape_keys=scrape_keys)
    report, details, ms = summarize(w, result, capacity_rps)
    details["calibration"] = {"per_word_tokens": round(cal.per_word, 4),
                              "overhead_tokens": round(cal.overhead, 2),
                              "continuous_usage": continuous}
    details["target"] = base_url
    details["prompt_salt"] = salt
    return Measurement(report, details, ms, result, cal)
