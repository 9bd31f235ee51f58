"""The overhead bench's --redis mode: its own redis-server, and the checks that Sluice and
LiteLLM really use it (commands per request, time inside Redis, key patterns, store
errors). See docs/overhead.md."""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loadtest import targets as procs
from loadtest.load_client import check_stream, open_loop
from loadtest.measure import (
    Step,
    Target,
)
from loadtest.report import ratio, say, verdict

CHECK_RATES = {"sluice": 100.0, "litellm": 10.0}
CHECK_IDLE_S = 1.0
CHECK_SETTLE_S = 0.3  # settlements run after the response; LiteLLM syncs every 0.1 s
MIN_EVALSHA_PER_REQUEST = 3.0  # reserve, capacity slot, release, settle: 4 expected


@dataclass(slots=True)
class RedisRun:
    """--redis: the bench's Redis, what reads it, and the counters when the load began."""

    service: procs.Service
    probe: procs.RedisProbe
    version: str
    gateway_port: int | None = None
    start: procs.CommandStats | None = None
    store_errors: float = 0.0  # the gateway's count when last read
    phases: list[dict[str, Any]] = field(default_factory=list)  # store errors, by phase

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.service.port}/0"

    def mark(self, phase: str, sustained: bool | None = None) -> float:
        """Store errors the gateway counted since the last mark, recorded under `phase`."""
        assert self.gateway_port is not None
        metrics = procs.metric_totals(procs.fetch_metrics(self.gateway_port))
        now = metrics.get("sluice_gateway_store_errors_total", 0.0)
        new, self.store_errors = now - self.store_errors, now
        self.phases.append({"phase": phase, "store_errors": new, "sustained": sustained})
        return new

    def live_members(self, key: str) -> int:
        """Members of a lease / slot ZSET (scores: expiry, µs of Redis TIME) not yet expired."""
        seconds, micros = self.probe.client.time()
        return int(self.probe.client.zcount(key, seconds * 1_000_000 + micros, "+inf"))


def per(counts: dict[str, float]) -> str:
    shown = [f"{name} {n:.2f}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1])
             if abs(n) >= 0.005]
    return ", ".join(shown) or "nothing"


async def redis_check(redis: RedisRun, gateways: list[Target], step_s: float,
                      chunks: int) -> dict[str, Any]:
    """Each gateway alone at a rate it sustains: Redis commands (and Redis CPU) per request."""
    probe = redis.probe
    seconds = min(2.0, step_s)
    say(f"\nadmission in Redis: each gateway alone, {seconds:g} s; Redis commands per "
         "request (minus what the idle window shows)")
    await asyncio.sleep(CHECK_SETTLE_S)
    before, cpu0, t0 = probe.commands(), redis.service.cpu_seconds(), time.monotonic()
    await asyncio.sleep(CHECK_IDLE_S)
    idle = procs.command_delta(before, probe.commands())
    idle_s = time.monotonic() - t0
    idle_cpu_per_s = (redis.service.cpu_seconds() - cpu0) / idle_s
    background = {name: calls / idle_s for name, (calls, _) in idle.items()}
    say(f"  {'idle':<10} per second: {per(background)}; redis-server CPU "
         f"{idle_cpu_per_s * 1e3:.0f} ms/s")
    out: dict[str, Any] = {"background_per_s": background,
                           "idle_redis_cpu_s_per_s": idle_cpu_per_s, "targets": {}}
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    for target in gateways:
        rate = CHECK_RATES.get(target.name, 10.0)
        before, cpu0, t0 = probe.commands(), redis.service.cpu_seconds(), time.monotonic()
        samples = await open_loop(target.pool, rate, seconds, max_in_flight=round(rate) + 20)
        await asyncio.sleep(CHECK_SETTLE_S)
        after, elapsed = probe.commands(), time.monotonic() - t0
        cpu = redis.service.cpu_seconds() - cpu0 - idle_cpu_per_s * elapsed
        ok = sum(1 for sample in samples if not check_stream(sample, chunks))
        delta = procs.command_delta(before, after)
        per_request = {name: (calls - background.get(name, 0.0) * elapsed) / ok
                       for name, (calls, _) in delta.items()} if ok else {}
        calls, usec = delta.get("evalsha", (0, 0))
        # Time inside Redis: a script's inner commands are counted in its own time too, so
        # for a client that runs scripts, its scripts' time; else all of its commands'.
        inside = usec if calls else sum(u for _, u in delta.values())
        found = {"rate": rate, "requests": len(samples), "ok": ok,
                 "commands": {name: list(v) for name, v in delta.items()},
                 "per_request": per_request, "evalsha_per_request": per_request.get("evalsha", 0.0),
                 "redis_usec_per_evalsha": usec / calls if calls else None,
                 "redis_usec_per_request": inside / ok if ok else None,
                 "redis_cpu_us_per_request": cpu / ok * 1e6 if ok else None,
                 "redis_cpu_resolution_us": tick / ok * 1e6 if ok else None}
        out["targets"][target.name] = found
        notes = ""
        if ok:
            notes = (f"; inside Redis {found['redis_usec_per_request']:.0f} us/request"
                     + ("" if not calls else
                        f" ({found['redis_usec_per_evalsha']:.0f} us per EVALSHA)")
                     + f"; redis-server CPU {found['redis_cpu_us_per_request']:.0f} "
                       f"± {found['redis_cpu_resolution_us']:.0f} us/request")
        say(f"  {target.name:<10} {rate:g}/s, {ok} of {len(samples)} ok, per request: "
             f"{per(per_request)}{notes}")
    out["keys_after_check"] = keys_by_owner(probe.key_patterns())
    for owner, patterns in out["keys_after_check"].items():
        say(f"  keys of {owner}: " + (", ".join(f"{k} ({n})" for k, n in patterns.items())
                                       or "none"))
    return out


def store_errors_note(redis: RedisRun, name: str) -> Callable[[Step], str]:
    """A sweep's `on_step`: the store errors of each step, noted in its log line."""
    def note(step: Step) -> str:
        new = redis.mark(f"{name} sweep at {step.rate:g}/s", step.sustained)
        return f"  [{new:.0f} store errors]" if new else ""
    return note


def keys_by_owner(patterns: dict[str, int]) -> dict[str, dict[str, int]]:
    """Sluice's keys start with `sluice:`; the only other client of the bench's Redis is
    LiteLLM."""
    out: dict[str, dict[str, int]] = {"sluice": {}, "litellm": {}}
    for pattern, n in patterns.items():
        out["sluice" if pattern.startswith("sluice:") else "litellm"][pattern] = n
    return out


def redis_summary(redis: RedisRun, report: dict[str, Any]) -> list[dict[str, Any]]:
    """After the load: the gateway's admission counters, Redis's totals; checks."""
    info = report["redis"]
    assert redis.start is not None and redis.gateway_port is not None
    total = procs.command_delta(redis.start, redis.probe.commands())
    text = procs.fetch_metrics(redis.gateway_port)
    metrics = procs.metric_totals(text)
    # Admitted = reserved in Redis and settled there. sluice_gateway_dispatched_total counts
    # only requests that waited in the queue: one that finds room passes the capacity gate
    # (one EVALSHA) straight away and is not counted there.
    settled = metrics.get("sluice_gateway_requests_settled_total", 0.0)
    queued = metrics.get("sluice_gateway_dispatched_total", 0.0)
    store_errors = metrics.get("sluice_gateway_store_errors_total", math.nan)
    refused = (metrics.get("sluice_gateway_rejects_total", 0.0)
               + metrics.get("sluice_gateway_fail_open_total", 0.0))
    evalsha = total.get("evalsha", (0, 0))[0]
    info["totals"] = {"commands": {name: list(v) for name, v in total.items()},
                      "evalsha": evalsha, "sluice_settled": settled,
                      "sluice_dispatched_from_queue": queued,
                      "evalsha_per_settled": evalsha / settled if settled else None}
    info["gateway_metrics"] = {name: value for name, value in metrics.items()
                               if name.startswith("sluice_gateway_")}
    info["gateway_metric_lines"] = [line for name in (
        "sluice_gateway_requests_settled_total", "sluice_gateway_dispatched_total",
        "sluice_gateway_responses_total", "sluice_gateway_store_errors_total",
        "sluice_gateway_rejects_total", "sluice_gateway_fail_open_total",
        "sluice_gateway_leases_live", "sluice_gateway_slots_held")
        for line in procs.metric_lines(text, name)]
    info["keys_at_end"] = keys_by_owner(redis.probe.key_patterns())
    info["store_errors_by_phase"] = redis.phases
    overloaded = [p for p in redis.phases if p["sustained"] is False and p["store_errors"]]
    kept_up = sum(p["store_errors"] for p in redis.phases
                  if p["sustained"] is not False)
    leases = redis.live_members("sluice:{bench}:leases")
    slots = redis.live_members("sluice:{up:fake}:slots")
    info["live_in_redis_at_end"] = {"leases": leases, "slots": slots}
    say(f"\nadmission in Redis, whole run: Sluice admitted and settled {settled:.0f} requests "
         f"({queued:.0f} of them waited in the queue), {evalsha} EVALSHA in all "
         f"({ratio(evalsha, settled)} per request), store errors {store_errors:.0f}, refused "
         f"by a quota {refused:.0f}, leases live at the end "
         f"{metrics.get('sluice_gateway_leases_live', math.nan):.0f} (in Redis: {leases} "
         f"leases, {slots} capacity slots)")
    if overloaded:
        say("  store errors in sweep steps Sluice did not sustain (overloaded: the store "
             "deadline is timed on the gateway's own busy event loop): "
             + ", ".join(f"{p['store_errors']:.0f} in the {p['phase']}" for p in overloaded))
    sluice = info["targets"].get("sluice", {})
    verdicts = [
        verdict("store errors where Sluice kept up (= 0)", kept_up, kept_up == 0),
        verdict("sluice_gateway_store_errors_total, whole run (= 0)", store_errors,
                 store_errors == 0),
        verdict("requests refused by a quota or admitted fail-open (= 0)", refused,
                 refused == 0),
        verdict("sluice_gateway_requests_settled_total (> 0)", settled, settled > 0),
        verdict(f"EVALSHA per request, Sluice alone (>= {MIN_EVALSHA_PER_REQUEST:g})",
                 sluice.get("evalsha_per_request"),
                 sluice.get("evalsha_per_request", 0.0) >= MIN_EVALSHA_PER_REQUEST),
    ]
    if "litellm" in info["targets"]:
        keys = sum(info["keys_after_check"]["litellm"].values())
        writes = info["targets"]["litellm"]["per_request"]
        verdicts.append(verdict("LiteLLM's keys in Redis after its check (> 0)", keys,
                                 keys > 0 and sum(writes.values()) > 0))
    return verdicts
