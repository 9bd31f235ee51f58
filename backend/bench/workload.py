"""The mixed serving workload: heavy-tailed lengths, Poisson arrivals, all seeded.

Prompt and output lengths are drawn log-uniformly (jointly, independently of each other)
between the issue's bounds: most requests are short and a few are long, which is the
shape of ShareGPT-like chat traffic and is what makes static batching pay for padding.
Arrivals are a Poisson process: exponential gaps at a given rate.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace


@dataclass(slots=True, frozen=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int  # generated exactly (ignore_eos): the request's output length
    arrival: float  # seconds after the start of the run


@dataclass(slots=True, frozen=True)
class WorkloadSpec:
    num_requests: int
    prompt_len: tuple[int, int]  # inclusive bounds
    output_len: tuple[int, int]
    token_id_range: tuple[int, int]  # prompt ids drawn from [lo, hi)


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def make_requests(spec: WorkloadSpec, seed: int, prefix: str = "r") -> list[BenchRequest]:
    """Requests with lengths drawn from ``seed``; arrivals all 0 (see ``with_arrivals``)."""
    rng = random.Random(seed)
    lo, hi = spec.token_id_range
    out = []
    for i in range(spec.num_requests):
        n_prompt = _log_uniform(rng, *spec.prompt_len)
        n_out = _log_uniform(rng, *spec.output_len)
        prompt = [rng.randrange(lo, hi) for _ in range(n_prompt)]
        out.append(BenchRequest(f"{prefix}{i}", prompt, n_out, 0.0))
    return out


def with_arrivals(requests: list[BenchRequest], rate: float, seed: int) -> list[BenchRequest]:
    """Poisson arrivals at ``rate`` requests/s; the first request arrives at 0."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i, r in enumerate(requests):
        if i > 0:
            t += rng.expovariate(rate)
        out.append(replace(r, arrival=t))
    return out


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), q in [0, 100]."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(slots=True, frozen=True)
class RunStats:
    """What one serving run of the workload achieved."""

    name: str
    output_tokens: int
    span_s: float  # first arrival -> last finish
    ttft_s: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.span_s if self.span_s > 0 else float("nan")

    @property
    def ttft_p50(self) -> float:
        return percentile(self.ttft_s, 50)

    @property
    def ttft_p99(self) -> float:
        return percentile(self.ttft_s, 99)
