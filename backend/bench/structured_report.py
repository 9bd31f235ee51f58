"""The table ``python -m backend.bench.structured`` prints from its figures, and the
percentiles it reports."""

from __future__ import annotations

from typing import Any

TARGETS = {"1": 0.7, "32": 0.85}  # tokens/s ratio, constrained ÷ free (issue 24)


def pct(xs: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``xs``, linearly interpolated."""
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def format_table(result: dict[str, Any]) -> str:
    d = result["details"]
    lines = [(f"json_schema vs free text: model {d['model']} ({d['dtype']}, {d['device']}, "
              f"vocab {d['vocab_size']}, {d['threads']} threads), prompt {d['prompt_len']}, "
              f"temperature {d['temperature']}, {d['rounds']} rounds"),
             (f"{'batch':>5} {'tokens':>9} {'json tok/s':>10} {'free tok/s':>10} "
              f"{'ratio':>6} {'step ms':>8} {'free':>6} {'fwd ms':>7} {'free':>6} "
              f"{'target':>6}")]
    for b, t in result["throughput"].items():
        target = TARGETS.get(b)
        verdict = "" if target is None else (
            f"{target:>6} {'PASS' if t['tokens_per_s_ratio'] >= target else 'FAIL'}")
        lines.append(
            f"{b:>5} {t['output_tokens_min']:>4}-{t['output_tokens_max']:<4} "
            f"{t['tokens_per_s']:10.1f} {t['free_tokens_per_s']:10.1f} "
            f"{t['tokens_per_s_ratio']:6.3f} {t['step_ms']:8.2f} {t['free_step_ms']:6.2f} "
            f"{t['forward_ms']:7.2f} {t['free_forward_ms']:6.2f} {verdict}")
    lines += ["", ("free text alone, the same runs before any constrained step and after all "
                   "of them: tokens/s after / before, forward ms before -> after")]
    for b, t in result["throughput"].items():
        lines.append(f"{b:>5} {t['unconstrained_after_over_before']:6.3f}  "
                     f"{t['unconstrained_forward_ms_before']:.2f} -> "
                     f"{t['unconstrained_forward_ms_after']:.2f}")
    lines += ["", ("mask time per constrained step, ms p50 / p99: engine (job start to "
                   "applied), worker compute, step's wait after the forward, apply")]
    for b, m in result["mask"].items():
        lines.append(f"{b:>5} " + "  ".join(
            f"{k} {m[k + '_ms_p50']:.3f} / {m[k + '_ms_p99']:.3f}"
            for k in ("engine", "compute", "wait", "apply"))
            + f"  ready before the forward ended {m['ready_before_forward_end']:.0%}")
    c, h = result["compile"], result["cache"]
    lines += ["", f"compile (check + first mask), {c['schemas']} schemas: p50 "
              f"{c['compile_ms_p50']:.2f} ms, p99 {c['compile_ms_p99']:.2f} ms; p50 by "
              "properties " + ", ".join(f"{k}: {v:.2f}"
                                        for k, v in c['compile_ms_p50_by_properties'].items()),
              (f"first request, alone (TTFT ms): new schema {c['first_request_ttft_ms']:.2f}, "
               f"cached {c['cached_schema_ttft_ms']:.2f}, free text {c['free_ttft_ms']:.2f}"),
              (f"cache: {h['requests']} requests over {h['distinct_schemas']} schemas: "
               f"{h['compiles']} compiles, {h['cache_hits']} hits, "
               f"hit rate {h['hit_rate']:.3f}")]
    return "\n".join(lines)
