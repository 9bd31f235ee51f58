"""Bench sizes: the full run (the issue's figures), --quick (< 60 s on 2 cores), tests."""

from __future__ import annotations

from dataclasses import dataclass

from .checkpoint import FULL_MODEL, QUICK_MODEL, TEST_MODEL, ModelSpec
from .workload import WorkloadSpec

# Prompt ids are drawn from the bundled tokenizer's ordinary ids (specials are 0..3).
TOKEN_RANGE = (4, 1024)
ROOFLINE_BATCHES = (1, 8, 32)


@dataclass(slots=True, frozen=True)
class BenchSettings:
    name: str
    model: ModelSpec
    workload: WorkloadSpec
    # Offered Poisson rate = load x the continuous engine's measured capacity (requests/s
    # of the same workload served as one burst). 1.0: offered at what continuous sustains.
    load: float
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_memory_gib: float
    roofline_ctx: int
    roofline_steps: int
    roofline_rounds: int  # paired (machine, steps) rounds; the ratio is their median
    prefix_system_len: int
    prefix_suffix_len: tuple[int, int]
    prefix_requests: int
    run_hf: bool = True
    seed: int = 0
    # TTFT under concurrency (concurrency.py): closed-loop streams, equal prompts
    concurrency_streams: int = 32
    concurrency_prompt_len: int = 128
    concurrency_output_len: int = 64
    concurrency_requests: int = 128


FULL = BenchSettings(
    name="full", model=FULL_MODEL,
    workload=WorkloadSpec(64, (16, 1024), (8, 512), TOKEN_RANGE),
    load=1.0, max_num_seqs=64, max_num_batched_tokens=512, kv_memory_gib=2.0,
    roofline_ctx=512, roofline_steps=16, roofline_rounds=5,
    prefix_system_len=512, prefix_suffix_len=(8, 32), prefix_requests=8,
)

QUICK = BenchSettings(
    name="quick", model=QUICK_MODEL,
    workload=WorkloadSpec(32, (16, 256), (8, 128), TOKEN_RANGE),
    load=1.0, max_num_seqs=64, max_num_batched_tokens=256, kv_memory_gib=0.25,
    roofline_ctx=128, roofline_steps=8, roofline_rounds=3,
    prefix_system_len=512, prefix_suffix_len=(8, 32), prefix_requests=4,
    concurrency_output_len=16, concurrency_requests=64,
)

# For tests: every piece on a tiny model, seconds in all.
TEST = BenchSettings(
    name="test", model=TEST_MODEL,
    workload=WorkloadSpec(6, (4, 40), (2, 8), TOKEN_RANGE),
    load=1.0, max_num_seqs=32, max_num_batched_tokens=64, kv_memory_gib=0.02,
    roofline_ctx=16, roofline_steps=2, roofline_rounds=2,
    prefix_system_len=64, prefix_suffix_len=(2, 6), prefix_requests=2,
    concurrency_streams=4, concurrency_prompt_len=8, concurrency_output_len=2,
    concurrency_requests=8,
)
