"""Serve a workload on the engine in real time: requests join at their arrival times.

The driver owns the synchronous ``LLMEngine`` and does what ``ThreadTransport``'s worker
does, without the thread hop: between two steps it adds every request whose arrival time
has passed (stamped with that arrival time, so a request that lands during a step waits
for it, as it would in the server), then runs one step. When nothing is running it sleeps
until the next arrival.
"""

from __future__ import annotations

import time
from collections import deque

from backend.engine.builder import EngineParts
from backend.engine.outputs import OutputDelta
from backend.engine.sampling import SamplingParams

from .workload import BenchRequest, RunStats


def bench_params(max_tokens: int) -> SamplingParams:
    """Greedy, exactly ``max_tokens`` tokens (EOS ignored)."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def serve(parts: EngineParts, requests: list[BenchRequest], name: str) -> RunStats:
    """Run ``requests`` to completion on ``parts.core`` honouring their arrival times."""
    core = parts.core
    clock = core.clock
    pending = deque(sorted(requests, key=lambda r: r.arrival))
    finals: dict[str, OutputDelta] = {}
    start = clock()
    while pending or core.has_work():
        now = clock()
        while pending and start + pending[0].arrival <= now:
            r = pending.popleft()
            core.add_request(r.request_id, r.prompt_token_ids, bench_params(r.max_tokens),
                             arrival_time=start + r.arrival)
        if not core.has_work():
            time.sleep(max(0.0, start + pending[0].arrival - clock()))
            continue
        for delta in core.step():
            if delta.finished:
                finals[delta.request_id] = delta
    return finished_stats(name, requests, finals, start)


def finished_stats(name: str, requests: list[BenchRequest], finals: dict[str, OutputDelta],
           start: float) -> RunStats:
    missing = [r.request_id for r in requests if r.request_id not in finals]
    if missing:
        raise RuntimeError(f"{name}: {len(missing)} request(s) never finished: {missing[:5]}")
    ttfts: list[float] = []
    last_finish = start
    tokens = 0
    for r in requests:
        d = finals[r.request_id]
        if d.num_output_tokens != r.max_tokens or d.finish_reason != "length":
            raise RuntimeError(f"{name}: {r.request_id} generated {d.num_output_tokens} of "
                               f"{r.max_tokens} tokens ({d.finish_reason})")
        m = d.metrics
        assert m is not None and m.ttft is not None and m.finished_time is not None
        ttfts.append(m.ttft)
        last_finish = max(last_finish, m.finished_time)
        tokens += d.num_output_tokens
    first_arrival = start + min(r.arrival for r in requests)
    return RunStats(name, tokens, last_finish - first_arrival, ttfts)


def warm_up(parts: EngineParts, prompt_len: int, max_tokens: int = 4) -> None:
    """One short batch so first-call costs (allocator, thread pool) are not measured."""
    reqs = [BenchRequest(f"warm{i}", [5 + (i * 7 + j) % 100 for j in range(prompt_len)],
                         max_tokens, 0.0) for i in range(4)]
    serve(parts, reqs, "warm-up")
