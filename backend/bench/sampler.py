"""The step's sampling, batched against the per-row baseline: ``python -m backend.bench.sampler``.

For each batch size, ``sample()`` over realistic logits ([N, 32000] float32, random) is
timed in the same run with the engine's batched sampler (``backend.engine.sampler``) and
the per-row sampler it replaced (``per_row_sample`` below: a Python loop of tensor ops per
random row, kept here only as the baseline), in rotating order; figures are medians over
rounds. Workloads: all greedy; seeded top-p/top-k/temperature rows (what the engine did
before penalties existed); and, batched only, the same rows with presence/frequency
penalties over 256 output tokens and a 16-entry logit bias, and with ``logprobs: 5``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from backend.engine.sampler import (
    make_generator,
    sample,
    sample_batch,
    token_logprobs,
    torch_argmax,
)
from backend.engine.sampling import SamplingParams

VOCAB = 32000


def per_row_sample(logits: torch.Tensor, params: list[SamplingParams],
                   generators: list[torch.Generator | None]) -> list[int]:
    """The sampler before batching (no penalties, bias or logprobs): one row at a time."""
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    out = [0] * len(params)
    if greedy_rows:
        if len(greedy_rows) == len(params):
            return torch_argmax(logits)
        for i, tok in zip(greedy_rows, torch_argmax(logits[greedy_rows])):
            out[i] = tok
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if 0 < p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, idx = torch.sort(row, descending=True)
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            cum = torch.cumsum(sorted_probs, dim=-1)
            drop = (cum - sorted_probs) >= p.top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            row = torch.empty_like(row).scatter_(0, idx, sorted_logits)
        out[i] = int(torch.multinomial(torch.softmax(row, dim=-1), 1,
                                       generator=generators[i]).item())
    return out


def workloads(n: int) -> dict[str, list[SamplingParams]]:
    rng = random.Random(n)
    seeded = [SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=i) for i in range(n)]
    bias = tuple((rng.randrange(VOCAB), rng.uniform(-5, 5)) for _ in range(16))
    bias = tuple(dict(bias).items())
    penalized = [SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=i,
                                presence_penalty=0.5, frequency_penalty=0.3, logit_bias=bias)
                 for i in range(n)]
    return {"greedy": [SamplingParams(temperature=0)] * n, "seeded": seeded,
            "penalties+bias": penalized,
            "seeded+logprobs5": [SamplingParams(temperature=0.8, top_p=0.95, top_k=50,
                                                seed=i, logprobs=5) for i in range(n)]}


def median_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def compare(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]],
            baseline: bool, rounds: int,
            reps: int) -> tuple[float | None, float, float]:
    """(per-row ms or None, batched ms, all-rows ms): medians over rounds, the sides in
    rotating order. All rows: ``sample_batch`` (the device sampler) on the CPU, the
    logprobs left out."""
    def gens() -> list[torch.Generator | None]:
        return [None if p.greedy else make_generator(p.seed or 0) for p in params]

    def batched() -> object:
        toks = sample(logits, params, gens(), torch_argmax, outputs)
        return token_logprobs(logits, params, toks)

    def per_row() -> object:
        return per_row_sample(logits, params, gens())

    def all_rows() -> object:
        return sample_batch(logits, params, gens(), outputs).tolist()

    fns = {"batched": batched, "per-row": per_row, "all-rows": all_rows}
    sides: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    for r in range(rounds):
        for side in order[r % 3:] + order[:r % 3]:
            if side == "per-row" and not baseline:
                continue
            sides[side].append(median_ms(fns[side], reps))
    old = statistics.median(sides["per-row"]) if baseline else None
    return old, statistics.median(sides["batched"]), statistics.median(sides["all-rows"])


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"{'batch':>5} {'workload':<18} {'per-row ms':>10} {'batched ms':>10} {'ratio':>6}"
          f" {'all-rows ms':>11}")
    for n in (int(b) for b in args.batches.split(",")):
        logits = torch.randn(n, VOCAB) * 3
        outputs = [[random.randrange(VOCAB) for _ in range(256)] for _ in range(n)]
        for name, params in workloads(n).items():
            old_ms, new_ms, all_ms = compare(logits, params, outputs,
                                             name in ("greedy", "seeded"), args.rounds,
                                             args.reps)
            if old_ms is not None:
                print(f"{n:>5} {name:<18} {old_ms:>10.3f} {new_ms:>10.3f} "
                      f"{new_ms / old_ms:>6.2f} {all_ms:>11.3f}")
            else:
                print(f"{n:>5} {name:<18} {'-':>10} {new_ms:>10.3f} {'-':>6} {all_ms:>11.3f}")


if __name__ == "__main__":
    main()
