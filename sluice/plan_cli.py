"""`sluice plan`: read a model's config.json (and optionally a workload), print the KV
capacity plan as text or JSON. The arithmetic lives in `sluice.plan`.

Exit status: 0 the plan fits; 1 the weights leave no room for a single KV block; 2 bad
input (size, dtype, path, shape).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from modelfiles.model_config import ModelConfig

from .plan import (
    GIB,
    QUANTIZATIONS,
    LengthMix,
    Plan,
    PlanError,
    PlanInput,
    kv_bytes_per_element,
    make_plan,
    parse_size,
    resolved_kv_dtype,
    validate,
)


def load_model_config(path: str) -> ModelConfig:
    """A model directory holding config.json, or the config.json file itself."""
    from modelfiles.errors import ModelLoadError

    p = Path(path)
    try:
        if p.is_dir():
            return ModelConfig.from_dir(p)
        if not p.is_file():
            raise PlanError(f"--model {path}: no such directory or file")
        data = json.loads(p.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise PlanError(f"--model {path}: not a JSON object")
        return ModelConfig.from_hf(data)
    except ModelLoadError as exc:
        raise PlanError(f"--model {path}: {exc}") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        if isinstance(exc, PlanError):
            raise
        raise PlanError(f"--model {path}: cannot read it: {exc}") from None


def workload_pairs(path: str) -> list[tuple[int, int, float]]:
    """(input, output, probability) over every class of a `sluice loadtest` workload file
    (`loadtest.workload`: each class's length pairs, weighted by its share)."""
    from loadtest.workload import load_workload

    try:
        workload = load_workload(path)  # WorkloadError (a ValueError) names the bad field
        classes = [(float(c.share), list(c.length_pairs())) for c in workload.classes]
    except ValueError as exc:
        raise PlanError(f"--workload {path}: {exc}") from None
    return _mix_classes(path, classes)


def _mix_classes(path: str,
                 classes: list[tuple[float, list[tuple[int, int, float]]]]
                 ) -> list[tuple[int, int, float]]:
    """Each class's weights normalized, scaled by the class's share."""
    out: list[tuple[int, int, float]] = []
    for share, pairs in classes:
        total = sum(w for _, _, w in pairs)
        if share < 0 or total <= 0 or any(i < 0 or o < 0 or w < 0 for i, o, w in pairs):
            raise PlanError(f"--workload {path}: a class has a negative share, length or "
                            "weight, or no weight at all")
        out += [(i, o, share * w / total) for i, o, w in pairs]
    return out


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def _bytes(n: int) -> str:
    if n >= GIB:
        return f"{_gib(n)} = {n:,} B"
    if n >= 1 << 20:
        return f"{n / (1 << 20):,.2f} MiB = {n:,} B"
    return f"{n / 1024:,.1f} KiB = {n:,} B" if n >= 1024 else f"{n:,} B"


_FORMATS = {"int8": "int8 per output channel", "int4": "int4 in groups of 128"}


def _fallback_lines(plan: Plan, fallback: Plan, inp: PlanInput) -> list[str]:
    """The unquantized fallback beside the quantized plan: what falling back costs."""
    q = inp.quantization
    first = (f"unquantized fallback ({inp.weight_dtype} weights): "
             f"{_bytes(fallback.weight_bytes)}; KV pool {_gib(max(0, fallback.kv_pool_bytes))}"
             f" (quantized: {_gib(max(0, plan.kv_pool_bytes))}); KV blocks "
             f"{fallback.kv_blocks:,} (quantized: {plan.kv_blocks:,})")
    lines = [first]
    pairs = [(f"at {plan.context:,} tokens", plan.max_sequences_at_context,
              fallback.max_sequences_at_context)]
    if plan.max_sequences_at_workload is not None \
            and fallback.max_sequences_at_workload is not None:
        pairs.append(("at the workload's lengths", plan.max_sequences_at_workload,
                      fallback.max_sequences_at_workload))
    for where, quantized, unquantized in pairs:
        ratio = f"{quantized / unquantized:.2f}x" if unquantized else "the fallback fits none"
        lines.append(f"max concurrent sequences {where}: {q} {quantized:,}, fallback "
                     f"{unquantized:,} ({ratio})")
    return lines


def render(plan: Plan, cfg: ModelConfig, inp: PlanInput, gpu_text: str,
           fallback: Plan | None = None) -> str:
    kv_dtype = resolved_kv_dtype(inp)
    lines: list[str] = []
    add = lines.append
    add(f"model: {cfg.architecture}, {cfg.num_hidden_layers} layers, "
        f"{cfg.num_key_value_heads} KV heads x head dim {cfg.head_dim}, "
        f"{cfg.max_position_embeddings} positions")
    if inp.quantization is not None:
        add(f"weights: {plan.parameters:,} parameters, {_FORMATS[inp.quantization]} "
            f"(float32 scales), norms and biases {inp.weight_dtype} = "
            f"{_bytes(plan.weight_bytes)}")
    else:
        add(f"weights: {plan.parameters:,} parameters x {inp.weight_dtype} = "
            f"{_bytes(plan.weight_bytes)}")
    add(f"KV per token ({kv_dtype}): 2 x {cfg.num_hidden_layers} x {cfg.num_key_value_heads} x "
        f"{cfg.head_dim} x {kv_bytes_per_element(kv_dtype)} B = "
        f"{_bytes(plan.kv_bytes_per_token)}")
    add(f"KV per sequence at {plan.context:,} tokens: {_bytes(plan.kv_bytes_per_sequence)}")
    if plan.sequences is not None and plan.sequences_kv_bytes is not None:
        verdict = "fit" if plan.sequences_fit else "do NOT fit"
        add(f"KV for {plan.sequences:,} unshared sequences at {plan.context:,} tokens: "
            f"{_bytes(plan.sequences_kv_bytes)} ({verdict} in the KV pool)")
    add(f"GPU memory: {gpu_text} x {inp.utilization:.2f} usable = {_gib(plan.usable_bytes)}; "
        f"KV pool after weights: {_gib(max(0, plan.kv_pool_bytes))}")
    if not plan.fits:
        add(f"DOES NOT FIT: the weights leave no room for one KV block "
            f"({_bytes(plan.block_bytes)}); use more memory, fewer bytes per weight, "
            "or tensor parallelism")
        if fallback is not None:
            lines += _fallback_lines(plan, fallback, inp)
        return "\n".join(lines)
    add(f"KV blocks: {plan.kv_blocks:,} of {plan.block_size} tokens, "
        f"{_bytes(plan.block_bytes)} each")
    add(f"block rounding: {plan.rounding_tokens_at_context} unused token slots per sequence "
        f"at {plan.context:,} tokens; at most {plan.block_size - 1} per sequence "
        f"({_bytes((plan.block_size - 1) * plan.kv_bytes_per_token)})")
    add(f"max concurrent sequences at {plan.context:,} tokens: "
        f"{plan.max_sequences_at_context:,}")
    if plan.max_sequences_at_workload is not None:
        add(f"max concurrent sequences at the workload's lengths: "
            f"{plan.max_sequences_at_workload:,} (input + output: mean "
            f"{plan.workload_mean_tokens or 0:,.1f} tokens in "
            f"{plan.workload_mean_blocks or 0:,.2f} blocks; rounding wastes "
            f"{plan.workload_rounding_fraction or 0:.1%} of the KV held)")
        if plan.workload_refused_fraction:
            add(f"  {plan.workload_refused_fraction:.1%} of the workload's requests exceed "
                f"{plan.context:,} tokens and are refused")
    if fallback is not None:
        lines += _fallback_lines(plan, fallback, inp)
    basis = "workload" if plan.max_sequences_at_workload is not None else "context"
    if plan.replicas == 1:
        add("replicas: 1: no headroom; a failed replica takes all capacity with it "
            "(plan for --replicas 2 or more)")
    else:
        share = (plan.replicas - 1) / plan.replicas
        add(f"replicas: {plan.replicas} x {plan.fleet_sequences // plan.replicas:,} = "
            f"{plan.fleet_sequences:,} sequences ({basis} lengths); with one failed: "
            f"{plan.surviving_sequences:,}; keep each replica at or below "
            f"{plan.safe_sequences_per_replica:,} sequences ({share:.0%}) so the others "
            "absorb a failed one")
    return "\n".join(lines)


def _plan(args: argparse.Namespace) -> int:
    try:
        gpu = parse_size(args.gpu_memory)
        cfg = load_model_config(args.model)
        inp = PlanInput(gpu_bytes=gpu, weight_dtype=args.dtype, kv_dtype=args.kv_dtype,
                        context=args.context, block_size=args.block_size,
                        replicas=args.replicas, utilization=args.gpu_utilization,
                        sequences=args.sequences, quantization=args.quantization)
        context = validate(inp, cfg)
        mix = None
        if args.workload is not None:
            mix = LengthMix.from_weighted(workload_pairs(args.workload), context)
        plan = make_plan(cfg, inp, mix)
        fallback = None if inp.quantization is None else \
            make_plan(cfg, replace(inp, quantization=None), mix)
    except PlanError as exc:
        print(f"sluice plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = asdict(plan)
        out.update(fits=plan.fits, weight_dtype=inp.weight_dtype,
                   kv_dtype=resolved_kv_dtype(inp), gpu_bytes=gpu,
                   gpu_utilization=inp.utilization, quantization=inp.quantization)
        if fallback is not None:
            out["fallback"] = {**asdict(fallback), "fits": fallback.fits}
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        print(render(plan, cfg, inp, args.gpu_memory, fallback))
    return 0 if plan.fits else 1


def register(sub: Any) -> None:
    """Add `sluice plan` to the `sluice` parser."""
    p = sub.add_parser("plan", help="KV-cache capacity plan for a model on a GPU",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR|CONFIG.json",
                   help="checkpoint directory (its config.json is read) or a config.json")
    p.add_argument("--gpu-memory", required=True, metavar="SIZE",
                   help="memory of one GPU: 80GiB, 24GiB, 81559MiB, 80GB (powers of 1000)")
    p.add_argument("--gpu-utilization", type=float, default=0.90, metavar="F",
                   help="share of the GPU the engine may use (default 0.90, vLLM's)")
    p.add_argument("--dtype", default="bf16",
                   help="weight dtype: bf16 (default), fp16, fp32, fp8, int8, int4")
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="plan Sluice's quantized weights (`sluice backend --quantization`; "
                        "--dtype is then the model dtype) beside the unquantized fallback")
    p.add_argument("--kv-dtype", default=None,
                   help="KV cache dtype: bf16, fp16, fp32, fp8 (default: the weights' dtype)")
    p.add_argument("--context", type=int, default=None, metavar="T",
                   help="tokens per sequence (default: the model's max_position_embeddings)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (16)")
    p.add_argument("--workload", default=None, metavar="YAML",
                   help="load-test workload: size concurrency at its length distribution")
    p.add_argument("--replicas", type=int, default=1, help="replicas serving the model")
    p.add_argument("--sequences", type=int, default=None, metavar="N",
                   help="also size N unshared sequences at the context length")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_plan)
