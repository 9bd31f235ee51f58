"""TTFT under concurrency: ``streams`` closed-loop clients, each sending its next request
as soon as its last one ends, every prompt ``prompt_len`` tokens (issue #23: side by side
with vLLM CPU at 32 streams and 128-token prompts, our TTFT p50 was 0.54x theirs but the p99
1.48x; the target is p99 <= 2x p50).

The first ``streams`` requests arrive together (the burst a load test starts with); from
then on a request arrives when one ends, as from a closed-loop load generator. TTFT is
measured for every request, arrival in the engine to first token.

What bounds the tail: the last request of the burst cannot have its first token before the
whole burst is prefilled, ``streams × prompt_len`` tokens, whatever the order.
``prefill_rate`` measures the engine's prefill throughput on the same engine (steps of
nothing but whole prompts, as many as the step budget holds), so the run reports the
burst's slowest TTFT against that bound (``burst_over_bound``: 1.0 is a scheduler that
loses nothing to ordering or interleaved decodes) and the TTFT spread of the requests
after the burst (``steady``).
"""

from __future__ import annotations

import random
import statistics
import time
from collections import deque
from dataclasses import dataclass

from backend.engine.builder import EngineParts
from backend.engine.outputs import OutputDelta

from .serving import bench_params, finished_stats
from .workload import BenchRequest, RunStats, percentile


def closed_loop_requests(num_requests: int, prompt_len: int, output_len: int,
                         token_range: tuple[int, int], seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    lo, hi = token_range
    return [BenchRequest(f"cc{i}", [rng.randrange(lo, hi) for _ in range(prompt_len)],
                         output_len, 0.0) for i in range(num_requests)]


def serve_closed_loop(parts: EngineParts, requests: list[BenchRequest], streams: int,
                      name: str) -> RunStats:
    """Run ``requests`` keeping ``streams`` of them in the engine at all times."""
    core = parts.core
    clock = core.clock
    pending = deque(requests)
    finals: dict[str, OutputDelta] = {}
    start = clock()

    def submit() -> None:
        r = pending.popleft()
        core.add_request(r.request_id, r.prompt_token_ids, bench_params(r.max_tokens),
                         arrival_time=clock())

    for _ in range(min(streams, len(pending))):
        submit()
    while core.has_work():
        for delta in core.step():
            if delta.finished:
                finals[delta.request_id] = delta
                if pending:
                    submit()
    return finished_stats(name, requests, finals, start)


def prefill_rate(parts: EngineParts, prompt_len: int, token_range: tuple[int, int],
                 rounds: int = 5, seed: int = 77) -> float:
    """Prompt tokens per second of steps that only prefill whole prompts, as many as the
    step budget holds (one output token each; the median of ``rounds`` steps)."""
    core = parts.core
    per_step = max(1, core.scheduler.max_num_batched_tokens // prompt_len)
    reqs = closed_loop_requests(per_step * rounds, prompt_len, 1, token_range, seed)
    times = []
    for r in range(rounds):
        for req in reqs[r * per_step:(r + 1) * per_step]:
            core.add_request(req.request_id, req.prompt_token_ids, bench_params(1))
        began = time.perf_counter()
        while core.has_work():
            core.step()
        times.append(time.perf_counter() - began)
    return per_step * prompt_len / statistics.median(times)


@dataclass(slots=True, frozen=True)
class Tail:
    """The TTFT tail of a closed-loop run, against what bounds it."""

    burst_slowest_s: float  # the slowest TTFT of the first ``streams`` requests
    burst_bound_s: float  # streams x prompt_len / prefill rate
    steady_p50_s: float  # requests after the burst
    steady_p99_s: float

    @property
    def burst_over_bound(self) -> float:
        return self.burst_slowest_s / self.burst_bound_s

    @property
    def steady_p99_over_p50(self) -> float:
        return self.steady_p99_s / self.steady_p50_s


def tail(run: RunStats, streams: int, prompt_len: int, rate: float) -> Tail:
    """``run``'s TTFTs are in request order: the first ``streams`` are the burst."""
    burst, steady = run.ttft_s[:streams], run.ttft_s[streams:]
    return Tail(max(burst), streams * prompt_len / rate, percentile(steady, 50),
                percentile(steady, 99))
