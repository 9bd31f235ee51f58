"""Run every measurement of the bench, side by side, and collect the figures."""

from __future__ import annotations

import gc
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from backend.engine.builder import EngineParts, build_engine
from backend.engine.config import EngineConfig

from . import concurrency, hf_baseline, prefix, roofline
from .checkpoint import write_checkpoint
from .serving import serve, warm_up
from .settings import ROOFLINE_BATCHES, BenchSettings
from .static_batching import with_static_batching
from .workload import RunStats, make_requests, with_arrivals

log = logging.getLogger("sluice.bench")


@dataclass(slots=True)
class BenchResult:
    """The target figures (``figures``) and what they were computed from (``details``)."""

    figures: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    runs: dict[str, RunStats] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {**self.figures, "details": self.details}


def _engine(settings: BenchSettings, path: Path, device: str, dtype: str,
            **overrides: Any) -> EngineParts:
    cfg = EngineConfig(model=str(path), device=device, dtype=dtype,
                       kv_memory_gib=settings.kv_memory_gib,
                       max_num_seqs=settings.max_num_seqs,
                       max_num_batched_tokens=settings.max_num_batched_tokens,
                       max_model_len=settings.model.max_positions, seed=settings.seed,
                       **overrides)
    return build_engine(cfg)


def _collect() -> None:
    """Release a dropped engine's weights and KV cache before the next one is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _run_stats(s: RunStats) -> dict[str, float]:
    return {"output_tokens": s.output_tokens, "span_s": s.span_s,
            "tokens_per_s": s.tokens_per_s, "ttft_p50_s": s.ttft_p50,
            "ttft_p99_s": s.ttft_p99}


def run_bench(settings: BenchSettings, device: str = "cpu", dtype: str = "bfloat16",
              progress: Callable[[str], None] = lambda _m: None) -> BenchResult:
    """Measure everything; ``progress`` gets one line per phase."""
    res = BenchResult()
    t_start = time.monotonic()
    torch_dtype = getattr(torch, dtype)
    spec = settings.model
    tmp = tempfile.TemporaryDirectory(prefix="sluice-bench-")
    try:
        path = write_checkpoint(Path(tmp.name) / "model", spec, torch_dtype, settings.seed)
        dev = torch.device(device)
        machine = roofline.measure_machine(dev, torch_dtype, settings.name != "full")
        progress(f"machine: copy {machine.copy_gbps:.1f} GB/s, matmul "
                 f"{machine.matmul_gflops_dtype:.0f} GFLOP/s {dtype} / "
                 f"{machine.matmul_gflops_fp32:.0f} fp32")
        res.details.update(
            settings=settings.name, device=device, dtype=dtype,
            torch_threads=torch.get_num_threads(), load_average=os.getloadavg()[0],
            model_params=spec.num_params, matmul_params=spec.matmul_params,
            copy_gbps=machine.copy_gbps, matmul_gflops=machine.matmul_gflops,
            matmul_gflops_dtype=machine.matmul_gflops_dtype,
            matmul_gflops_fp32=machine.matmul_gflops_fp32)

        # 1. Continuous batching: calibrate the arrival rate, then the Poisson run.
        w = settings.workload
        requests = make_requests(w, settings.seed)
        parts = _engine(settings, path, device, dtype)
        warm_up(parts, 32)
        burst = serve(parts, [replace(r, request_id="cal-" + r.request_id) for r in requests],
                      "calibration")
        rate = settings.load * len(requests) / burst.span_s
        progress(f"calibration (burst, continuous): {burst.tokens_per_s:.0f} tok/s, "
                 f"{burst.span_s:.1f} s -> offered rate {rate:.2f} req/s")
        timed = with_arrivals(requests, rate, settings.seed + 1)
        res.runs["continuous"] = serve(parts, timed, "continuous")
        progress(f"continuous: {res.runs['continuous'].tokens_per_s:.0f} tok/s")

        # 2. Decode step vs roofline, on the same engine.
        ratios: dict[str, float] = {}
        steps: dict[str, dict[str, Any]] = {}
        for b in ROOFLINE_BATCHES:
            rounds = roofline.decode_step_rounds(
                parts, b, settings.roofline_ctx, settings.roofline_steps, w.token_id_range,
                settings.roofline_rounds,
                lambda: roofline.measure_machine(dev, torch_dtype, settings.name != "full"))
            roofs = [roofline.roofline_s(spec, torch_dtype, b, r.context, r.machine)
                     for r in rounds]
            per_round = [r.seconds / roof for r, roof in zip(rounds, roofs, strict=True)]
            ratios[str(b)] = statistics.median(per_round)
            steps[str(b)] = {
                "step_ms": statistics.median(r.seconds for r in rounds) * 1e3,
                "roofline_ms": statistics.median(roofs) * 1e3,
                "context": statistics.median(r.context for r in rounds),
                "copy_gbps": statistics.median(r.machine.copy_gbps for r in rounds),
                "matmul_gflops": statistics.median(r.machine.matmul_gflops for r in rounds),
                "round_ratios": per_round}
        progress("decode/roofline: " + ", ".join(f"B={b} {r:.2f}" for b, r in ratios.items()))

        # 3. Prefix cache on (this engine) vs off (a fresh one).
        preqs = prefix.prefix_requests(settings.prefix_system_len, settings.prefix_suffix_len,
                                       settings.prefix_requests, w.token_id_range,
                                       settings.seed + 2)
        ttft_on = prefix.mean_ttft(parts, preqs, "cache")
        del parts
        _collect()
        parts = _engine(settings, path, device, dtype, enable_prefix_cache=False)
        warm_up(parts, 32)
        ttft_off = prefix.mean_ttft(parts, preqs, "nocache")
        del parts
        _collect()
        progress(f"prefix cache: TTFT {ttft_on * 1e3:.1f} ms on, {ttft_off * 1e3:.1f} ms off")

        # 3b. TTFT under concurrency: closed-loop streams of equal prompts.
        parts = _engine(settings, path, device, dtype)
        warm_up(parts, 32)
        creqs = concurrency.closed_loop_requests(
            settings.concurrency_requests, settings.concurrency_prompt_len,
            settings.concurrency_output_len, w.token_id_range, settings.seed + 3)
        res.runs["concurrency"] = cc = concurrency.serve_closed_loop(
            parts, creqs, settings.concurrency_streams, "concurrency")
        prefill_tps = concurrency.prefill_rate(parts, settings.concurrency_prompt_len,
                                        w.token_id_range)
        cc_tail = concurrency.tail(cc, settings.concurrency_streams,
                                   settings.concurrency_prompt_len, prefill_tps)
        del parts
        _collect()
        progress(f"concurrency {settings.concurrency_streams}: TTFT p50 "
                 f"{cc.ttft_p50 * 1e3:.0f} ms, p99 {cc.ttft_p99 * 1e3:.0f} ms; burst slowest "
                 f"{cc_tail.burst_slowest_s * 1e3:.0f} ms, bound "
                 f"{cc_tail.burst_bound_s * 1e3:.0f} ms (prefill {prefill_tps:.0f} tok/s)")

        # 4. Static batching on the same engine (``static_batching.py``).
        parts = with_static_batching(_engine(settings, path, device, dtype))
        warm_up(parts, 32)
        res.runs["static"] = serve(parts, timed, "static")
        del parts
        _collect()
        progress(f"static: {res.runs['static'].tokens_per_s:.0f} tok/s")

        # 5. transformers generate.
        if settings.run_hf:
            model = hf_baseline.load_hf_model(path, torch_dtype, dev)
            hf_baseline.warm_up_hf(model, dev)
            res.runs["hf"] = hf_baseline.serve_hf(model, timed, settings.max_num_seqs, dev)
            del model
            _collect()
            progress(f"hf generate: {res.runs['hf'].tokens_per_s:.0f} tok/s")
    finally:
        tmp.cleanup()

    cont, static = res.runs["continuous"], res.runs["static"]
    hf = res.runs.get("hf")
    res.figures = {
        "continuous_vs_static_tokens_per_s": cont.tokens_per_s / static.tokens_per_s,
        "static_over_continuous_p99_ttft": static.ttft_p99 / cont.ttft_p99,
        "continuous_vs_hf_generate_tokens_per_s":
            cont.tokens_per_s / hf.tokens_per_s if hf else float("nan"),
        "decode_step_over_roofline": ratios,
        "prefix_cache_ttft_speedup": ttft_off / ttft_on,
        "concurrency_ttft_p99_over_p50": res.runs["concurrency"].ttft_p99
        / res.runs["concurrency"].ttft_p50,
        "concurrency_burst_ttft_over_bound": cc_tail.burst_over_bound,
        "concurrency_steady_ttft_p99_over_p50": cc_tail.steady_p99_over_p50,
    }
    res.details.update(
        offered_load=settings.load, offered_rate_req_s=rate, calibration=_run_stats(burst),
        runs={k: _run_stats(v) for k, v in res.runs.items()},
        decode_steps=steps,
        prefix_ttft_ms={"cache": ttft_on * 1e3, "no_cache": ttft_off * 1e3},
        concurrency={"streams": settings.concurrency_streams,
                     "prompt_len": settings.concurrency_prompt_len,
                     "output_len": settings.concurrency_output_len,
                     "requests": settings.concurrency_requests,
                     "max_num_batched_tokens": settings.max_num_batched_tokens,
                     "prefill_tokens_per_s": prefill_tps,
                     "burst_slowest_ttft_ms": cc_tail.burst_slowest_s * 1e3,
                     "burst_bound_ms": cc_tail.burst_bound_s * 1e3,
                     "steady_ttft_p50_ms": cc_tail.steady_p50_s * 1e3,
                     "steady_ttft_p99_ms": cc_tail.steady_p99_s * 1e3},
        workload={"requests": w.num_requests, "prompt_len": list(w.prompt_len),
                  "output_len": list(w.output_len),
                  "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
                  "output_tokens": sum(r.max_tokens for r in requests)},
        wall_s=time.monotonic() - t_start, load_average_end=os.getloadavg()[0])
    return res
