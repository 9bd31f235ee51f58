"""Decode step time against a roofline measured on this machine, in the same run.

roofline(B, C) = max(bytes / copy bandwidth, FLOPs / matmul rate) for one decode step of
B sequences at context C:

* bytes  = every matmul weight once (layers + LM head) + B embedding rows
           + K/V of B x C cached tokens read + B new tokens' K/V written;
* FLOPs  = 2 x matmul params x B + attention 4 x B x C x heads x head_dim x layers;
* copy bandwidth = (read + write bytes) / time of one large tensor copy (STREAM "copy");
* matmul rate = ``F.linear`` on a large square-ish shape, the better of the model dtype and
  float32: on a CPU without bf16 hardware a bf16 model can (and the engine does) multiply
  in float32, so the fp32 rate is what is achievable; on a GPU the model dtype is faster.

The measured step is the median wall time of ``LLMEngine.step()`` (schedule, forward,
logits to the CPU, sampling, detokenization) while all B sequences decode (no prefill),
in rounds, each set against the machine measured right before it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backend.engine.builder import EngineParts

from .checkpoint import ModelSpec
from .serving import bench_params


@dataclass(slots=True, frozen=True)
class Machine:
    copy_gbps: float  # (read + write) GB/s
    matmul_gflops: float  # the rate the roofline uses
    matmul_gflops_dtype: float  # F.linear in the model dtype
    matmul_gflops_fp32: float


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    fn()
    sync_device(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync_device(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _copy_gbps(device: torch.device, nbytes: int) -> float:
    # The source is written first: untouched pages all map the zero page, which caches.
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_time(lambda: dst.copy_(src), device, 5) / 1e9


def measure_machine(device: torch.device, dtype: torch.dtype, quick: bool) -> Machine:
    copy_gbps = _copy_gbps(device, (128 if quick else 512) << 20)

    def rate(dt: torch.dtype) -> float:
        m, k, n = (512, 1024, 2048) if quick else (1024, 2048, 4096)
        if device.type == "cuda":
            m, k, n = 8192, 8192, 8192
        a = torch.randn(m, k, device=device).to(dt)
        w = torch.randn(n, k, device=device).to(dt)
        return 2 * m * k * n / _median_time(lambda: F.linear(a, w), device, 3) / 1e9

    r_dtype = rate(dtype)
    r_fp32 = rate(torch.float32) if dtype != torch.float32 else r_dtype
    return Machine(copy_gbps, max(r_dtype, r_fp32), r_dtype, r_fp32)


def roofline_s(spec: ModelSpec, dtype: torch.dtype, batch: int, ctx: float,
               machine: Machine) -> float:
    elem = torch.empty((), dtype=dtype).element_size()
    kv_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * elem
    nbytes = (spec.matmul_params + batch * spec.hidden_size) * elem \
        + batch * ctx * kv_per_token + batch * kv_per_token
    flops = 2 * spec.matmul_params * batch \
        + 4 * batch * ctx * spec.num_heads * spec.head_dim * spec.num_layers
    return max(nbytes / (machine.copy_gbps * 1e9), flops / (machine.matmul_gflops * 1e9))


@dataclass(slots=True, frozen=True)
class StepRound:
    seconds: float  # median step time of the round
    context: float  # mean context during the round
    machine: Machine  # measured right before the round


def decode_step_rounds(parts: EngineParts, batch: int, ctx: int, steps: int,
                       token_range: tuple[int, int], rounds: int,
                       measure: Callable[[], Machine]) -> list[StepRound]:
    """Median ``step()`` time with ``batch`` sequences decoding at context ~``ctx``, in
    ``rounds`` rounds of ``steps`` steps, the machine measured right before each: a shared
    VM's speed drifts by tens of percent within minutes, so each round's step is set
    against the machine as it was then (the bench reports the median of the rounds'
    ratios)."""
    core = parts.core
    lo, hi = token_range
    ids = [f"roof-{batch}-{ctx}-{i}" for i in range(batch)]
    # Rows whose prefill ends early decode while the others prefill: leave them room.
    prefill_steps = -(-batch * ctx // core.scheduler.max_num_batched_tokens) + batch
    for i, rid in enumerate(ids):
        prompt = [lo + (i * 131 + j * 7) % (hi - lo) for j in range(ctx)]
        core.add_request(rid, prompt, bench_params(rounds * steps + prefill_steps + 4))
    started: set[str] = set()
    while len(started) < batch:  # prefill (chunked) until every row has its first token
        started.update(d.request_id for d in core.step())
    core.step()  # one decode step untimed: every row now decodes
    seqs = [core.scheduler.get(rid) for rid in ids]
    out_rounds = []
    for _ in range(rounds):
        machine = measure()
        ctx_before = sum(s.num_tokens for s in seqs if s is not None) / batch
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = core.step()
            times.append(time.perf_counter() - t0)
            if len(out) != batch:
                raise RuntimeError(f"decode step emitted {len(out)} tokens, expected {batch}")
        out_rounds.append(StepRound(statistics.median(times), ctx_before + steps / 2, machine))
    for rid in ids:
        core.abort(rid)
    return out_rounds
