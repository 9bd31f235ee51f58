"""The printed table and the pass/fail of each target."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .runner import BenchResult


@dataclass(slots=True, frozen=True)
class Row:
    metric: str
    ours: str
    baseline: str
    ratio: float
    target: str  # e.g. ">= 3" or "<= 1.5"; "" for no target

    @property
    def verdict(self) -> str:
        if not self.target or math.isnan(self.ratio):
            return "-" if not self.target else "n/a"
        op, bound = self.target.split()
        ok = self.ratio >= float(bound) if op == ">=" else self.ratio <= float(bound)
        return "PASS" if ok else "FAIL"


ROOFLINE_TARGETS = {"1": "<= 2.0", "8": "", "32": "<= 1.5"}


def rows(res: BenchResult) -> list[Row]:
    f, d, runs = res.figures, res.details, res.runs
    cont, static, hf = runs["continuous"], runs["static"], runs.get("hf")
    out = [
        Row("output tokens/s: continuous vs static", f"{cont.tokens_per_s:.1f}",
            f"{static.tokens_per_s:.1f}", f["continuous_vs_static_tokens_per_s"], ">= 3"),
        Row("p99 TTFT s: static / continuous", f"{cont.ttft_p99:.2f}",
            f"{static.ttft_p99:.2f}", f["static_over_continuous_p99_ttft"], ">= 5"),
        Row("output tokens/s: continuous vs HF generate", f"{cont.tokens_per_s:.1f}",
            f"{hf.tokens_per_s:.1f}" if hf else "skipped",
            f["continuous_vs_hf_generate_tokens_per_s"], ">= 3"),
    ]
    for b, ratio in f["decode_step_over_roofline"].items():
        s = d["decode_steps"][b]
        out.append(Row(f"decode step ms / roofline, B={b} (ctx {s['context']:.0f})",
                       f"{s['step_ms']:.2f}", f"{s['roofline_ms']:.2f}", ratio,
                       ROOFLINE_TARGETS.get(b, "")))
    p = d["prefix_ttft_ms"]
    out.append(Row("TTFT ms, shared 512-token prefix: no cache / cache",
                   f"{p['cache']:.1f}", f"{p['no_cache']:.1f}",
                   f["prefix_cache_ttft_speedup"], ">= 3"))
    c, cc = d["concurrency"], runs["concurrency"]
    out.append(Row(f"TTFT s, {c['streams']} closed-loop streams of {c['prompt_len']}-token "
                   "prompts: p99 / p50", f"{cc.ttft_p99:.3f}", f"{cc.ttft_p50:.3f}",
                   f["concurrency_ttft_p99_over_p50"], "<= 2"))
    out.append(Row("  the burst's slowest TTFT s / its prefill bound (streams x prompt / "
                   f"{c['prefill_tokens_per_s']:.0f} tok/s)",
                   f"{c['burst_slowest_ttft_ms'] / 1e3:.3f}", f"{c['burst_bound_ms'] / 1e3:.3f}",
                   f["concurrency_burst_ttft_over_bound"], ""))
    out.append(Row("  TTFT s after the burst: p99 / p50", f"{c['steady_ttft_p99_ms'] / 1e3:.3f}",
                   f"{c['steady_ttft_p50_ms'] / 1e3:.3f}",
                   f["concurrency_steady_ttft_p99_over_p50"], ""))
    return out


def render(res: BenchResult, extra: dict[str, float] | None = None) -> str:
    table = rows(res)
    header = ("metric", "ours", "baseline", "ratio", "target", "result")
    cells = [header] + [(r.metric, r.ours, r.baseline, f"{r.ratio:.2f}", r.target or "-",
                         r.verdict) for r in table]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(header))) for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    d = res.details
    lines.append("")
    w = d["workload"]
    lines.append(f"model {d['model_params'] / 1e6:.1f}M params, {d['dtype']} on {d['device']} "
                 f"({d['torch_threads']} threads); workload {w['requests']} requests, "
                 f"{w['prompt_tokens']} prompt / {w['output_tokens']} output tokens, Poisson "
                 f"at {d['offered_rate_req_s']:.2f} req/s (load {d['offered_load']:g}); "
                 f"copy {d['copy_gbps']:.1f} GB/s, matmul {d['matmul_gflops']:.0f} GFLOP/s; "
                 f"{d['wall_s']:.0f} s in all")
    if d.get("load_average", 0.0) > 0.5:
        lines.append(f"warning: load average was {d['load_average']:.2f} at the start; "
                     "other processes share these cores and skew absolute figures")
    for key, value in (extra or {}).items():
        lines.append(f"{key}: {value:.3f}")
    return "\n".join(lines)
