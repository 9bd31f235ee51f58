"""TTFT under concurrency: ``streams`` closed-loop clients, each sending its next request
as soon as its last one ends, every prompt ``prompt_len`` tokens (issue #23: side by side
with vLLM CPU at 32 streams and 128-token prompts, our TTFT p50 was 0.54x theirs but the p99
1.48x; the target is p99 <= 2x p50).

The first ``streams`` requests arrive together (the burst a load test starts with); from
then on a request arrives when one ends, as from a closed-loop load generator. TTFT is
measured for every request, arrival in the engine to first token.
"""

from __future__ import annotations

import random
from collections import deque

from backend.engine.builder import EngineParts
from backend.engine.outputs import OutputDelta

from .serving import bench_params, finished_stats
from .workload import BenchRequest, RunStats


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
