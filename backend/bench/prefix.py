"""Prefix cache: TTFT of requests sharing a long system prompt, cache on vs off.

Every request is the same ``system_len``-token system prompt followed by its own short
suffix. One warm-up request fills the cache (and warms both engines alike), then
``num_requests`` run one after another (each alone, so TTFT is pure prefill plus one
step, no queueing). With the cache, each request prefills only its suffix.
"""

from __future__ import annotations

import random
import statistics

from backend.engine.builder import EngineParts

from .serving import serve
from .workload import BenchRequest


def prefix_requests(system_len: int, suffix_len: tuple[int, int], num_requests: int,
                    token_range: tuple[int, int], seed: int) -> list[BenchRequest]:
    """The warm-up request first, then the measured ones (all max_tokens=1)."""
    rng = random.Random(seed)
    lo, hi = token_range
    system = [rng.randrange(lo, hi) for _ in range(system_len)]
    out = []
    for i in range(num_requests + 1):
        suffix = [rng.randrange(lo, hi) for _ in range(rng.randint(*suffix_len))]
        out.append(BenchRequest(f"prefix{i}", system + suffix, 1, 0.0))
    return out


def mean_ttft(parts: EngineParts, requests: list[BenchRequest], tag: str) -> float:
    """Mean TTFT over ``requests[1:]``, each served alone after ``requests[0]``."""
    ttfts = []
    for i, r in enumerate(requests):
        stats = serve(parts, [BenchRequest(f"{tag}-{r.request_id}", r.prompt_token_ids,
                                           r.max_tokens, 0.0)], tag)
        if i > 0:
            ttfts.append(stats.ttft_s[0])
    return statistics.mean(ttfts)
