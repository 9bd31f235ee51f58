"""The open-loop client of `sluice loadtest`: asyncio + httpx streaming.

Open loop: request *n* leaves at ``start + schedule[n].t`` whatever happened to the earlier
ones, so an overloaded target builds a queue, as real traffic does, instead of slowing the
client down (a closed loop hides overload: it only sends when answers come back). How
late each request actually left (``sent - scheduled``) is kept: a lagging client under-
loads the target, and the run is then flagged unreliable.

Each network read is stamped with ``time.perf_counter()`` the moment httpx hands it over,
before it is parsed; every SSE event in that read shares the stamp, since that is when its
bytes arrived. Tokens per event come from the server's running usage
(``continuous_usage_stats``) when it offers it, else from the final usage spread over the
events by text length (`tokens.py`); never one event = one token.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtest.arrivals import Planned
from loadtest.dataset import Entry
from loadtest.prompts import PROBE_WORDS, Calibration, PromptBook, words
from loadtest.workload import Workload

# A streamed request ends in exactly one of these (stats.py decides success vs slo_miss).
CANCEL_PATIENCE, CANCEL_TOKENS = "patience", "after_tokens"


@dataclass(slots=True)
class Record:
    """One request's timeline, in ``time.perf_counter()`` seconds."""

    plan: Planned
    scheduled: float = 0.0
    dispatched: float = 0.0  # the client started on it (dispatch lag = this - scheduled)
    sent: float = 0.0  # its last request byte was written (latencies count from here)
    done: float = 0.0
    status: int = 0
    queue_ms: float | None = None
    # (arrival time, tokens) per content event; tokens is -1 until tokens.py assigns it
    # from text length, when the server gave no running usage.
    events: list[tuple[float, int]] = field(default_factory=list)
    chars: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cancelled: str = ""  # CANCEL_PATIENCE / CANCEL_TOKENS when the client abandoned it
    timed_out: bool = False
    error: str = ""
    error_status: int = 0  # the HTTP status an in-stream error event carried (504: deadline)
    finished: bool = False  # the stream ended with [DONE] (or a whole JSON body)


@dataclass(slots=True, frozen=True)
class Target:
    base_url: str  # without /v1
    key: str | None
    timeout_s: float = 60.0
    continuous_usage: bool = True


def endpoint(w: Workload) -> str:
    return "/v1/chat/completions" if w.api == "chat" else "/v1/completions"


def request_body(w: Workload, p: Planned, prompts: PromptBook, target: Target,
                 entry: Entry | None = None) -> dict[str, Any]:
    """The request for ``p``: a synthetic prompt of its length, or the dataset ``entry``'s
    messages or prompt (``p`` then carries the entry's lengths)."""
    c = w.class_named(p.cls)
    body: dict[str, Any] = {"model": c.model or w.model, "stream": True,
                            "max_tokens": p.output_tokens + c.max_tokens_slack}
    if entry is not None and w.api == "chat" and entry.messages is not None:
        body["messages"] = [dict(m) for m in entry.messages]
    elif entry is not None and entry.prompt is not None:
        if w.api == "chat":
            body["messages"] = [{"role": "user", "content": entry.prompt}]
        else:
            body["prompt"] = entry.prompt
    else:
        text = prompts.text(p.idx, p.input_tokens, c.prefix_group)
        if w.api == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
    opts: dict[str, Any] = {"include_usage": True}
    if target.continuous_usage:
        opts["continuous_usage_stats"] = True
    body["stream_options"] = opts
    if w.ignore_eos and c.max_tokens_slack == 0:
        body["ignore_eos"] = True
    if p.priority is not None:
        body["priority"] = p.priority
    if c.deadline_ms is not None:
        body["deadline_ms"] = int(c.deadline_ms)
    return body


def _headers(key: str | None, idx: int) -> dict[str, str]:
    h = {"content-type": "application/json", "x-loadtest-idx": str(idx)}
    if key:
        h["authorization"] = f"Bearer {key}"
    return h


def _apply_event(rec: Record, payload: bytes, now: float) -> None:
    try:
        obj = json.loads(payload)
    except ValueError:
        rec.error = rec.error or "bad SSE JSON"
        return
    if not isinstance(obj, dict):
        return
    if "error" in obj:
        err = obj["error"] if isinstance(obj["error"], dict) else {}
        rec.error = rec.error or f"in-stream error: {err.get('message', obj['error'])}"
        if isinstance(err.get("status"), int):
            rec.error_status = err["status"]
        return
    usage = obj.get("usage") or None
    choices = obj.get("choices") or []
    text = ""
    for ch in choices:
        delta = ch.get("delta") or {}
        text += (delta.get("content") or "") if "delta" in ch else (ch.get("text") or "")
    if usage is not None:
        if usage.get("prompt_tokens") is not None:
            rec.prompt_tokens = int(usage["prompt_tokens"])
        count = usage.get("completion_tokens")
        if count is not None:
            if choices:  # a running count on a content event
                n = int(count) - (rec.completion_tokens or 0)
                if n > 0:
                    rec.events.append((now, n))
                    rec.chars.append(len(text))
            rec.completion_tokens = int(count)
            return
    if choices and text:
        rec.events.append((now, -1))
        rec.chars.append(len(text))


def tokens_seen(rec: Record) -> int:
    return sum(n if n > 0 else 1 for _, n in rec.events)


async def _read_stream(rec: Record, resp: httpx.Response, timer: asyncio.Timeout,
                       timeout_s: float) -> None:
    buf = b""
    async for raw in resp.aiter_raw():
        now = time.perf_counter()
        buf += raw
        *lines, buf = buf.split(b"\n")
        had_tokens = bool(rec.events)
        for line in lines:
            line = line.rstrip(b"\r")
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                rec.finished = True
                rec.done = now  # E2E ends when the last byte arrived, not after teardown
                continue
            _apply_event(rec, payload, now)
        if rec.events and not had_tokens:  # the first token: patience no longer applies
            timer.reschedule(asyncio.get_running_loop().time() + timeout_s - (now - rec.dispatched))
        after = rec.plan.cancel_after
        if after is not None and not rec.finished and tokens_seen(rec) >= after:
            rec.cancelled = CANCEL_TOKENS
            return  # leaving the `stream` block closes the connection: the server sees it


async def send_one(client: httpx.AsyncClient, url: str, key: str | None, body: bytes,
                   rec: Record, timeout_s: float) -> None:
    """Send one request and fill ``rec``; never raises (except on cancellation).

    ``sent`` is stamped by httpcore's trace hook when the request body has been written,
    so connection set-up and request encoding (client work) are not charged to the
    target; ``dispatched`` keeps when the client started on it.
    """
    loop = asyncio.get_running_loop()
    rec.dispatched = rec.sent = time.perf_counter()

    async def trace(event: str, info: dict[str, Any]) -> None:
        if event == "http11.send_request_body.complete":
            rec.sent = time.perf_counter()

    patience = rec.plan.patience_s
    first_limit = timeout_s if patience is None else min(patience, timeout_s)
    timer = asyncio.timeout_at(loop.time() + first_limit)
    try:
        async with timer, client.stream("POST", url, content=body,
                                 headers=_headers(key, rec.plan.idx),
                                 extensions={"trace": trace}) as resp:
            rec.status = resp.status_code
            rec.queue_ms = _queue_ms(resp.headers.get("x-sluice-queue-ms"))
            if resp.status_code != 200:
                text = (await resp.aread())[:300].decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {text}"
            elif resp.headers.get("content-type", "").startswith("text/event-stream"):
                await _read_stream(rec, resp, timer, timeout_s)
            else:
                rec.error = "not a stream"
    except TimeoutError:
        if not rec.events and patience is not None and patience < timeout_s:
            rec.cancelled = CANCEL_PATIENCE
        else:
            rec.timed_out = True
    except httpx.HTTPError as exc:
        rec.error = rec.error or f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - whatever a server sends is an outcome, never a crash
        rec.error = rec.error or f"{type(exc).__name__}: {exc}"
    if not rec.finished:
        rec.done = time.perf_counter()


def _queue_ms(raw: str | None) -> float | None:
    """The gateway's queue-time header; None when absent or not a finite number."""
    try:
        value = float(raw) if raw else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


PROBE_WAIT_S = 30.0  # how long the start-up probes may wait on 429/503 Retry-After
RETRY_MIN_S = 0.1  # never retry faster than this, whatever Retry-After says (0, a past date)


class ProbeRefused(RuntimeError):
    """The start-up probe got no usable answer (the message says why)."""


async def _probe(client: httpx.AsyncClient, url: str, key: str | None, w: Workload,
                 text: str, continuous: bool, budget: tuple[float, float],
                 say: Callable[[str], None]) -> httpx.Response:
    """One probe request; a 429 or 503 (a shedding target is what the tool is for) is
    tried again after its Retry-After while the budget lasts (``budget``: the loop time
    it ends at, and its length in seconds)."""
    body: dict[str, Any] = {"model": w.model, "max_tokens": 1, "stream": True,
                            "stream_options": {"include_usage": True}}
    if continuous:
        body["stream_options"]["continuous_usage_stats"] = True
    if w.api == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    loop = asyncio.get_running_loop()
    end, total = budget
    while True:
        resp = await client.post(url, json=body, headers=_headers(key, -1))
        if resp.status_code not in (429, 503):
            return resp
        from protocol.http import retry_after_s  # (starlette: not at every `sluice` start)

        pause = max(RETRY_MIN_S, retry_after_s(resp.headers))
        if loop.time() + pause > end:
            raise ProbeRefused(
                f"probe request refused: HTTP {resp.status_code} with Retry-After "
                f"{resp.headers.get('retry-after', '(none)')}; waited "
                f"{max(0.0, total - (end - loop.time())):.1f} s of --probe-wait {total:g} s: "
                f"{resp.text[:200]}")
        say(f"probe: HTTP {resp.status_code}, trying again in {pause:.3g} s (Retry-After)")
        await asyncio.sleep(pause)


def _prompt_tokens(resp: httpx.Response) -> int:
    for line in resp.text.splitlines():
        if line.startswith("data:") and "prompt_tokens" in line:
            try:
                usage = json.loads(line[5:]).get("usage") or {}
                if usage.get("prompt_tokens") is not None:
                    return int(usage["prompt_tokens"])
            except (ValueError, TypeError, AttributeError):
                raise ProbeRefused(f"the probe's answer is not OpenAI SSE: {line[:200]}"
                                   ) from None
    raise ProbeRefused("the target reports no usage.prompt_tokens; cannot size prompts")


async def calibrate(base_url: str, key: str | None, w: Workload, *,
                    wait_s: float = PROBE_WAIT_S,
                    say: Callable[[str], None] | None = None) -> tuple[Calibration, bool]:
    """(prompt calibration, whether the target streams running usage), from two probes.

    A target that refuses ``continuous_usage_stats`` (400) is probed again without it.
    A 429/503 is tried again after its Retry-After, within ``wait_s`` in all. The probes
    use ``key``, or else the first class's key.
    """
    url = base_url + endpoint(w)
    key = key or next((k for c in w.classes if (k := c.api_key(None))), None)
    budget = (asyncio.get_running_loop().time() + wait_s, wait_s)
    tell = say or (lambda line: print(line, file=sys.stderr, flush=True))
    async with httpx.AsyncClient(timeout=60.0) as client:
        continuous = True
        resp = await _probe(client, url, key, w, words(1, PROBE_WORDS[0]), True, budget, tell)
        if resp.status_code == 400:
            continuous = False
            resp = await _probe(client, url, key, w, words(1, PROBE_WORDS[0]), False, budget,
                                tell)
        if resp.status_code != 200:
            raise ProbeRefused(f"probe request failed: HTTP {resp.status_code}: "
                               f"{resp.text[:300]}")
        p1 = _prompt_tokens(resp)
        resp = await _probe(client, url, key, w, words(2, PROBE_WORDS[1]), continuous, budget,
                            tell)
        if resp.status_code != 200:
            raise ProbeRefused(f"probe request failed: HTTP {resp.status_code}: "
                               f"{resp.text[:300]}")
        p2 = _prompt_tokens(resp)
    return Calibration.from_probes(PROBE_WORDS[0], p1, PROBE_WORDS[1], p2), continuous
