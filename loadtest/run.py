"""One measured run of a workload against a target, start to finish.

calibrate prompts on the target -> (read and count the dataset) -> draw the schedule ->
send it, open or closed loop (progress bar, /metrics scraping) -> per-request metrics ->
the report dicts. `sluice loadtest`, both sweeps and `make capacity` all go through
`measure_workload`. An interrupted run (``stop`` set) still ends here: its report covers
the requests that ended, over the time it ran, marked partial.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.arrivals import Planned, cap_requests, requests_in_order, schedule
from loadtest.client import Record, Target, calibrate, request_body
from loadtest.dataset import Entry, prepare_dataset
from loadtest.prompts import Calibration, PromptBook
from loadtest.runner import Drive, RunResult, run_closed, run_schedule
from loadtest.stats import Measured
from loadtest.summary import summarize
from loadtest.urls import server_root
from loadtest.workload import Workload

EMPTY_WINDOW_S = 1e-3  # the window of a run that measured nothing (rates are then 0)


@dataclass(slots=True)
class Measurement:
    report: dict[str, Any]
    details: dict[str, Any]
    measured: list[Measured]
    result: RunResult
    calibration: Calibration
    sweep: list[dict[str, Any]] = field(default_factory=list)


def _progress(total: int | None, label: str) -> tuple[Any, Any]:
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


def _with_entries(plan: Planned, entries: list[Entry] | None) -> Planned:
    """With a dataset, request i is entry i mod len: its counted input length, and its
    reference answer's length when it has one."""
    if not entries:
        return plan
    e = entries[plan.idx % len(entries)]
    out = plan.output_tokens if e.output_tokens is None else e.output_tokens
    return dataclasses.replace(plan, input_tokens=e.input_tokens, output_tokens=out)


def _partial(w: Workload, result: RunResult) -> tuple[Workload, list[str]]:
    """An interrupted run: keep the requests that ended, measure over the time it ran (no
    window at all when it was stopped before ``warmup_s`` ended)."""
    cut = max(0.0, result.interrupted_at or 0.0)
    ended = [r for r in result.records if r.dispatched and r.done]
    in_flight = sum(1 for r in result.records if r.dispatched and not r.done)
    unsent = len(result.records) - len(ended) - in_flight
    end = min(w.duration_s - w.cooldown_s, cut)
    early = end <= w.warmup_s
    if early:
        end = w.warmup_s + EMPTY_WINDOW_S
    result.records = [_remeasured(r, w.warmup_s, end) for r in ended]
    if not any(r.plan.measured for r in result.records):
        # nothing measured: at least the empty window (a stop seen a fraction of a ms in
        # left one too short to show, and the report read a window of 0 s); every request
        # was sent before the cut, so none falls into the widened part
        end = max(end, w.warmup_s + EMPTY_WINDOW_S)
    eff = w.model_copy(update={"duration_s": end + w.cooldown_s})
    note = (f"partial: interrupted {cut:.1f} s into the run; the report covers the "
            f"{len(ended)} requests that ended ({in_flight} in flight were dropped"
            + (f", {unsent} never sent" if unsent and w.concurrency is None else "") + ")")
    if early:
        note += f"; before warmup_s ({w.warmup_s:g} s) ended, so nothing was measured"
    elif not any(r.plan.measured for r in result.records):
        # (a stop that came before the first send, seen a few ms late on a busy machine)
        note += "; no request ended inside the measured window, so nothing was measured"
    return eff, [note]


def _remeasured(rec: Record, w0: float, w1: float) -> Record:
    rec.plan = dataclasses.replace(rec.plan, measured=w0 <= rec.plan.t < w1)
    return rec


async def measure_workload(w: Workload, base_url: str, key: str | None, *,
                           timeout_s: float = 60.0, scrape: list[str] | None = None,
                           progress: bool = True, label: str = "",
                           calibration: tuple[Calibration, bool] | None = None,
                           capacity_rps: float | None = None,
                           prompt_salt: int | None = None,
                           scrape_key: str | None = None,
                           dataset: tuple[list[Entry], dict[str, Any]] | None = None,
                           dataset_dir: Path = Path("."),
                           stop: asyncio.Event | None = None) -> Measurement:
    """Run ``w`` once against ``base_url``. Prompts are new for every run (a random salt)
    unless ``prompt_salt`` pins them. ``scrape_key`` is the bearer key sent to the
    ``scrape`` URLs (a bundled backend's /metrics needs its API key), not to the target.
    ``dataset``: the prepared entries of ``w.dataset`` (prepared here, relative to
    ``dataset_dir``, when not given). ``stop`` set: the run ends early, marked partial."""
    base_url = server_root(base_url)
    w = cap_requests(w)
    cal, continuous = calibration or await calibrate(base_url, key, w)
    if dataset is None and w.dataset is not None:
        dataset = await prepare_dataset(w.dataset, api=w.api, seed=w.seed, base_url=base_url,
                                        key=key, model=w.model, base_dir=dataset_dir)
    entries = dataset[0] if dataset else None
    target = Target(base_url, key, timeout_s, continuous)
    salt = secrets.randbits(48) if prompt_salt is None else prompt_salt
    prompts = PromptBook(cal, w.seed, {g.name: g.tokens for g in w.prefix_groups}, salt,
                         {g.name: g.count for g in w.prefix_groups})

    def body_for(p: Planned) -> bytes:
        entry = entries[p.idx % len(entries)] if entries else None
        return json.dumps(request_body(w, p, prompts, target, entry)).encode()

    drive = Drive(w, target, body_for, {c.name: c.api_key(key) for c in w.classes},
                  [base_url] + [u for u in scrape or [] if u.rstrip("/") != base_url],
                  scrape_keys={u: scrape_key for u in scrape or []} if scrape_key else None,
                  stop=stop)
    if w.concurrency is None:
        plan = [_with_entries(p, entries) for p in schedule(w)]
        total: int | None = len(plan)
        title = f"{w.name} @ {w.mean_rate():.3g} rps"
    else:
        total, title = w.requests, f"{w.name}, {w.concurrency} concurrent"
    shown: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if progress:
        shown, drive.on_done = _progress(total, label or title)
    with shown:
        if w.concurrency is None:
            result = await run_schedule(drive, plan)
        else:
            result = await run_closed(drive, (_with_entries(p, entries)
                                              for p in requests_in_order(w)))
    eff, notes = w, list[str]()
    if w.concurrency is not None and result.wall_s < w.duration_s \
            and result.interrupted_at is None:
        # the request cap ended the run early: rates divide by the time it ran
        end = result.wall_s
        if end - w.cooldown_s <= w.warmup_s:
            notes.append(f"the request cap ended the run after {end:.2f} s, before "
                         f"warmup_s + cooldown_s ({w.warmup_s + w.cooldown_s:g} s): "
                         f"nothing was measured")
            end = w.warmup_s + w.cooldown_s + EMPTY_WINDOW_S
        eff = w.model_copy(update={"duration_s": end})
        result.records = [_remeasured(r, eff.warmup_s, end - eff.cooldown_s)
                          for r in result.records]
    if result.interrupted_at is not None:
        eff, notes = _partial(eff, result)
    report, details, ms = summarize(eff, result, capacity_rps)
    report["notes"][:0] = notes
    if result.interrupted_at is not None:
        report["partial"] = True
    details["mode"] = w.mode()
    details["calibration"] = {"per_word_tokens": round(cal.per_word, 4),
                              "overhead_tokens": round(cal.overhead, 2),
                              "continuous_usage": continuous}
    if dataset is not None:
        details["dataset"] = dataset[1]
    details["target"] = base_url
    details["prompt_salt"] = salt
    return Measurement(report, details, ms, result, cal)
