"""Weight quantization against the unquantized model, side by side:
``python -m backend.bench.quant``.

The bench model (``checkpoint.FULL_MODEL``, ~56M parameters, bf16 by default) is built as
three engines in one process: unquantized (``none``), ``int8`` and ``int4``
(``EngineConfig.quantization``; quantized at load from the same checkpoint). Reported:

* **quality**, on a fixed prompt set (seeded token ids): the unquantized model decodes
  greedily from every prompt, all prompts as one batch through the engine's decode path;
  each quantized model is then fed the same tokens (teacher forcing) and its next-token
  distributions are compared with the reference's: KL(ref || quant) mean and p99, top-1
  agreement, the mean absolute difference of the reference token's logprob, and sampled-token
  agreement at temperature 1 with shared randomness (Gumbel-max with the same noise on both
  sides: how often a seeded request would draw the same token). Then each quantized model
  decodes greedily on its own: the **greedy-sequence agreement length** is the number of
  leading tokens equal to the reference's (mean and min over prompts, out of ``--steps``);
* **weight memory**: ``weight_bytes`` as ``/v1/state`` reports it (every tensor the engine
  holds for weights: the unquantized CPU engine also keeps oneDNN's packed float32 copy)
  and the ratio to the unquantized model's own weights (its parameters in the model dtype);
* **decode tokens/s** at batch 1, 8 and 32 (``--batches``): every engine serves the same
  batch of requests (``--prompt``-token prompts), and once all of them decode, ``--decode``
  steps are timed. Each round times every engine once per batch, in a rotating order; a
  ratio is the median over rounds of that round's ratio (this VM's speed drifts), a rate
  the median over rounds;
* **prefill tokens/s**: one ``--prefill``-token prompt (one step), timed the same way.

``--matmul-rows 1,32,512`` times one step's matrices alone instead (every layer's and the
LM head, the bench model's random weights), each way in the same rounds: ``bf16_c`` (the
fused steps' C kernels on bf16, up to 64 rows), ``onednn`` (the prepacked float32 copy an
unquantized engine keeps), and per format the quantized matmul as the engine calls it,
its C kernels alone (``_c``) and its float32 tiles through oneDNN (``_tiles``).

The random bench model has flat next-token distributions (logits spread ~0.45), so its KL
is small in absolute terms; top-1 and sequence agreement are the sensitive figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from backend.engine.attention import build_attention_batch
from backend.engine.builder import EngineParts, build_engine
from backend.engine.config import EngineConfig
from backend.engine.decode_kernel import load_decode_kernel
from backend.engine.fused_decode import MAX_ROWS, QuantizedMatmul
from backend.engine.loader import load_model
from backend.engine.quant import quantize
from backend.engine.sampling import SamplingParams

from .checkpoint import FULL_MODEL, QUICK_MODEL, TEST_MODEL, write_checkpoint

MODELS = {"full": FULL_MODEL, "quick": QUICK_MODEL, "test": TEST_MODEL}
FORMATS = ("int8", "int4")
REFERENCE = "none"
# the targets (int8) and bound (int4)
INT8_MAX_KL = 0.01
INT8_MAX_MEMORY = 0.55
INT8_MIN_SPEEDUP_B1 = 1.4
INT4_MAX_MEMORY = 0.35


def decode_batch(parts: EngineParts, prompts: list[list[int]], steps: int,
                 forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill every prompt, then decode ``steps`` tokens for all of them as one batch;
    the logits [B, steps, V] of each position and the tokens fed back [B, steps]: the
    greedy picks, or ``forced``'s. Runs on the engine's model and KV cache directly (the
    engine must be idle): sequence i owns blocks [i * width, (i + 1) * width)."""
    runner = parts.runner
    model, kv, bs, dev = runner.model, runner.kv_caches, runner.block_size, runner.device
    longest = max(len(p) for p in prompts) + steps
    width = -(-longest // bs)
    if width * len(prompts) > parts.num_blocks:
        raise ValueError("the KV cache is too small for the prompt set")
    tables = [list(range(i * width, (i + 1) * width)) for i in range(len(prompts))]
    rows: list[torch.Tensor] = []
    tokens: list[torch.Tensor] = []
    with torch.inference_mode():
        for s in range(steps):
            if s == 0:  # the prompts' prefills, one forward each
                last = []
                for table, prompt in zip(tables, prompts, strict=True):
                    batch = build_attention_batch([(table, 0, len(prompt))], bs, dev)
                    ids = torch.tensor(prompt, dtype=torch.long, device=dev)
                    hidden = model(ids, batch.positions, kv, batch)
                    last.append(hidden[-1:])
                logits = model.compute_logits(torch.cat(last)).float().cpu()
            else:
                specs = [(t, len(p) + s - 1, 1) for t, p in zip(tables, prompts, strict=True)]
                batch = build_attention_batch(specs, bs, dev)
                ids = tokens[-1].to(dev).contiguous()  # a column of forced: strided
                hidden = model(ids, batch.positions, kv, batch)
                logits = model.compute_logits(hidden).float().cpu()
            rows.append(logits)
            tokens.append(logits.argmax(dim=-1) if forced is None else forced[:, s])
    return torch.stack(rows, dim=1), torch.stack(tokens, dim=1)


def quality(ref: EngineParts, quant: EngineParts, prompts: list[list[int]], steps: int,
            ref_out: tuple[torch.Tensor, torch.Tensor], seed: int) -> dict[str, float]:
    ref_logits, ref_tokens = ref_out
    logits, _ = decode_batch(quant, prompts, steps, forced=ref_tokens)
    p = ref_logits.log_softmax(dim=-1).flatten(0, 1)
    q = logits.log_softmax(dim=-1).flatten(0, 1)
    kl = (p.exp() * (p - q)).sum(dim=-1).clamp_min(0)
    picks = ref_tokens.flatten().unsqueeze(1)
    gen = torch.Generator().manual_seed(seed)
    gumbel = -torch.log(-torch.log(torch.rand(p.shape, generator=gen).clamp_(1e-20, 1.0)))
    _, own = decode_batch(quant, prompts, steps)
    agree = [int(((a != b).cumsum(0) == 0).sum()) for a, b in zip(ref_tokens, own, strict=True)]
    return {
        "kl_mean": float(kl.mean()), "kl_p99": float(torch.quantile(kl, 0.99)),
        "top1_agreement": float((p.argmax(-1) == q.argmax(-1)).float().mean()),
        "logprob_abs_diff": float((p.gather(1, picks) - q.gather(1, picks)).abs().mean()),
        "sampled_agreement": float(((p + gumbel).argmax(-1) == (q + gumbel).argmax(-1))
                                   .float().mean()),
        "greedy_agreement_mean": statistics.fmean(agree),
        "greedy_agreement_min": float(min(agree)),
    }


def _serve(parts: EngineParts, prompts: list[list[int]], max_tokens: int,
           timed_from: int) -> tuple[float, int]:
    """Serve ``prompts`` to the end; the seconds and tokens of the steps after every
    request has made ``timed_from`` tokens (0: from the first step)."""
    core = parts.core
    made = {}
    for i, prompt in enumerate(prompts):
        rid = f"q{i}"
        made[rid] = 0
        core.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                     ignore_eos=True))
    elapsed, tokens = 0.0, 0
    while core.has_work():
        timing = min(made.values()) >= timed_from
        t0 = time.perf_counter()
        deltas = core.step()
        dt = time.perf_counter() - t0
        for d in deltas:
            made[d.request_id] += len(d.token_ids)
        if timing:
            elapsed += dt
            tokens += sum(len(d.token_ids) for d in deltas)
    return elapsed, tokens


def speed(engines: dict[str, EngineParts], batches: list[int], prompt_len: int, decode: int,
          prefill: int, rounds: int, vocab: int, seed: int,
          progress: Callable[[str], None]) -> dict[str, Any]:
    """tokens/s per engine, decode at each batch size and prefill; ratios to the reference
    per round (median over rounds)."""
    names = list(engines)
    rng = random.Random(seed)
    cases = [(f"decode_b{b}", b) for b in batches] + [("prefill", 0)]
    rates: dict[str, dict[str, list[float]]] = {c: {n: [] for n in names} for c, _ in cases}
    for r in range(rounds):
        for case, b in cases:
            if b:  # fresh prompts each round: no prefix-cache hit
                prompts = [[rng.randrange(2, vocab) for _ in range(prompt_len)]
                           for _ in range(b)]
            else:
                prompts = [[rng.randrange(2, vocab) for _ in range(prefill)]]
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                if b:
                    secs, toks = _serve(engines[name], prompts, decode + 2, 1)
                else:
                    secs, toks = _serve(engines[name], prompts, 1, 0)
                    toks = prefill
                rates[case][name].append(toks / secs)
        progress(f"round {r + 1}/{rounds}: " + ", ".join(
            f"{c} " + "/".join(f"{rates[c][n][-1]:.0f}" for n in names) for c, _ in cases))
    out: dict[str, Any] = {}
    for case, _ in cases:
        ref = rates[case][REFERENCE]
        out[case] = {
            "tokens_per_s": {n: statistics.median(v) for n, v in rates[case].items()},
            "ratio": {n: statistics.median(a / b for a, b in zip(v, ref, strict=True))
                      for n, v in rates[case].items() if n != REFERENCE}}
    return out


def matmuls(args: argparse.Namespace, progress: Callable[[str], None]) -> dict[str, Any]:
    """One step's matrices at each of ``--matmul-rows``, every way side by side (ms)."""
    kernel = load_decode_kernel()
    if kernel is None:
        raise SystemExit("the C kernels did not build (no C compiler?)")
    with tempfile.TemporaryDirectory(prefix="sluice-quant-") as tmp:
        path = write_checkpoint(Path(tmp) / "model", MODELS[args.model], torch.bfloat16)
        model: Any = load_model(path, torch.bfloat16, torch.device("cpu")).model
    model.prepack_cpu_matmuls()
    model.set_decode_kernel(kernel)
    w, fused = model.decoder_weights(), model.fused
    mats = [(m, p) for lw in w.layers for m, p in zip(
        lw.matmuls, (lw.packed.qkv, lw.packed.o, lw.packed.gate_up, lw.packed.down),
        strict=True)] + [(w.lm_head, w.lm_head_packed)]
    quant: dict[str, list[QuantizedMatmul]] = {}
    for kind in (f for f in args.formats.split(",") if f):
        quant[kind] = [q for m, _ in mats if (q := kernel.quantized_matmul(
            quantize(m, kind), None)) is not None]
    out: dict[str, Any] = {}
    for n in [int(r) for r in args.matmul_rows.split(",")]:
        xs = {k: torch.randn(n, k) for k in {m.shape[1] for m, _ in mats}}
        sides: dict[str, Callable[[], object]] = {"onednn": functools.partial(
            _packed_step, [p for _, p in mats], [xs[m.shape[1]] for m, _ in mats])}
        if fused is not None and n <= MAX_ROWS:
            sides["bf16_c"] = functools.partial(_c_step, fused, mats, xs)
        for kind, qs in quant.items():
            for way in ("auto", "c", "tiles"):
                name = kind if way == "auto" else f"{kind}_{way}"
                sides[name] = functools.partial(_quant_step, qs, xs, way)
        times: dict[str, list[float]] = {name: [] for name in sides}
        names = list(sides)
        for f in sides.values():
            f()
        for r in range(args.rounds * 3):
            for name in names[r % len(names):] + names[:r % len(names)]:
                t0 = time.perf_counter()
                sides[name]()
                times[name].append(time.perf_counter() - t0)
        ref = "bf16_c" if "bf16_c" in times else "onednn"
        out[str(n)] = {"ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
                       "reference": ref,
                       "ratio": {k: statistics.median(a / b for a, b in zip(
                           v, times[ref], strict=True)) for k, v in times.items()}}
        progress(f"{n} rows: " + ", ".join(f"{k} {v:.2f} ms"
                                           for k, v in out[str(n)]["ms"].items()))
    return out


def _packed_step(packed: list[Callable[[torch.Tensor], torch.Tensor]],
                 xs: list[torch.Tensor]) -> None:
    for p, x in zip(packed, xs, strict=True):
        p(x)


def _c_step(fused: Any, mats: list[tuple[Any, Any]], xs: dict[int, torch.Tensor]) -> None:
    for m, _ in mats:
        fused.linear(xs[m.shape[1]], m, None)


def _quant_step(qs: list[QuantizedMatmul], xs: dict[int, torch.Tensor], way: str) -> None:
    for q in qs:
        q(xs[q.weight.shape[1]], way=way)


def format_matmuls(result: dict[str, Any]) -> str:
    head = ("one step's matrices, ms (ratio to the bf16 engine's way: bf16_c up to "
            f"{MAX_ROWS} rows, onednn above; median of per-round ratios)")
    lines = [head]
    for n, r in result.items():
        lines.append(f"{n:>4} rows: " + "  ".join(
            f"{k} {v:.2f} ({r['ratio'][k]:.2f})" for k, v in r["ms"].items()))
    return "\n".join(lines)


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict[str, Any]:
    spec = MODELS[args.model]
    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    formats = [f for f in args.formats.split(",") if f]
    prompts_rng = random.Random(args.seed)
    prompts = [[prompts_rng.randrange(2, spec.vocab_size) for _ in range(args.prompt)]
               for _ in range(args.prompts)]
    need = max(args.prompts * (args.prompt + args.steps), max(batches) * (args.prompt
               + args.decode + 2), args.prefill + 2)
    engines: dict[str, EngineParts] = {}
    with tempfile.TemporaryDirectory(prefix="sluice-quant-") as tmp:
        path = write_checkpoint(Path(tmp) / "model", spec, dtype)
        for name in (REFERENCE, *formats):
            engines[name] = build_engine(EngineConfig(
                model=str(path), device=args.device, dtype=args.dtype,
                quantization=None if name == REFERENCE else name,
                kv_blocks=-(-need // 16) + max(batches) + args.prompts, max_num_seqs=64,
                max_num_batched_tokens=max(512, args.prefill), enable_prefix_cache=False,
                num_threads=args.threads or None))
            progress(f"{name}: {engines[name].core.state().weight_bytes / 1e6:.1f} MB of "
                     "weights held")
    ref = engines[REFERENCE]
    model_bytes = spec.num_params * dtype.itemsize
    ref_out = decode_batch(ref, prompts, args.steps)
    result: dict[str, Any] = {"weights": {}, "quality": {}}
    for name, parts in engines.items():
        held = parts.core.state().weight_bytes
        result["weights"][name] = {"weight_bytes": held,
                                   "ratio_to_model_weights": held / model_bytes,
                                   "ratio_to_reference_held": held
                                   / ref.core.state().weight_bytes}
        if name != REFERENCE:
            result["quality"][name] = quality(ref, parts, prompts, args.steps, ref_out,
                                              args.seed)
            progress(f"{name}: {result['quality'][name]}")
    result["speed"] = speed(engines, batches, args.prompt, args.decode, args.prefill,
                            args.rounds, spec.vocab_size, args.seed + 1, progress)
    result["details"] = {
        "model": args.model, "params": spec.num_params, "dtype": args.dtype,
        "device": args.device, "model_weight_bytes": model_bytes,
        "threads": torch.get_num_threads(), "prompts": args.prompts,
        "prompt_len": args.prompt, "steps": args.steps, "rounds": args.rounds,
        "decode_steps": args.decode, "prefill_len": args.prefill,
        "engine_versions": {n: p.versions.versions.engine for n, p in engines.items()}}
    return result


def format_table(result: dict[str, Any]) -> str:
    names = list(result["weights"])
    quants = [n for n in names if n != REFERENCE]
    d = result["details"]
    head = (f"bench model {d['model']} ({d['params'] / 1e6:.1f}M params, {d['dtype']}, "
            f"{d['device']}, {d['threads']} threads); {d['prompts']} prompts x "
            f"{d['prompt_len']} tokens, {d['steps']} steps; {d['rounds']} rounds")
    lines = [head, ""]
    lines.append(f"{'':34}" + "".join(f"{n:>12}" for n in names))
    w = result["weights"]
    lines.append(f"{'weight bytes held (MB)':34}"
                 + "".join(f"{w[n]['weight_bytes'] / 1e6:12.1f}" for n in names))
    lines.append(f"{'  / model weights in ' + d['dtype']:34}"
                 + "".join(f"{w[n]['ratio_to_model_weights']:12.3f}" for n in names))
    q = result["quality"]
    for key, label in (("kl_mean", "KL mean"), ("kl_p99", "KL p99"),
                       ("top1_agreement", "top-1 agreement"),
                       ("logprob_abs_diff", "|logprob diff| of ref token"),
                       ("sampled_agreement", "sampled agreement (T=1, same noise)"),
                       ("greedy_agreement_mean", f"greedy agreement (of {d['steps']})"),
                       ("greedy_agreement_min", "  min over prompts")):
        lines.append(f"{label:34}{'-':>12}" + "".join(f"{q[n][key]:12.4g}" for n in quants))
    for case, figures in result["speed"].items():
        rates = figures["tokens_per_s"]
        lines.append(f"{case + ' tokens/s':34}" + "".join(f"{rates[n]:12.1f}" for n in names))
        lines.append(f"{'  ratio (median of rounds)':34}{'1':>12}"
                     + "".join(f"{figures['ratio'][n]:12.2f}" for n in quants))
    lines += ["", ("targets: int8 KL mean <= 0.01, memory <= 0.55x, batch-1 decode >= 1.4x; "
                   "int4 memory <= 0.35x")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.bench.quant", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="full")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated")
    ap.add_argument("--prompts", type=int, default=32, help="prompts in the quality set")
    ap.add_argument("--prompt", type=int, default=64, help="tokens per prompt")
    ap.add_argument("--steps", type=int, default=64, help="decoded tokens per prompt")
    ap.add_argument("--batches", default="1,8,32", help="decode batch sizes")
    ap.add_argument("--decode", type=int, default=24, help="timed decode steps per batch")
    ap.add_argument("--prefill", type=int, default=512, help="prefill prompt tokens")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--matmul-rows", default=None, metavar="N,N",
                    help="time one step's matrices alone at these row counts instead")
    ap.add_argument("--json", type=Path, metavar="FILE", help="also write the figures here")
    args = ap.parse_args(argv)
    if any(f not in FORMATS for f in args.formats.split(",") if f):
        ap.error(f"--formats: a comma-separated subset of {','.join(FORMATS)}")
    if min(args.prompts, args.prompt, args.steps, args.decode, args.prefill, args.rounds) < 1:
        ap.error("--prompts, --prompt, --steps, --decode, --prefill, --rounds must be >= 1")
    def progress(m: str) -> None:
        print(f"[quant] {m}", file=sys.stderr, flush=True)

    if args.matmul_rows:
        result = matmuls(args, progress)
        print(format_matmuls(result))
    else:
        result = run(args, progress)
        print(format_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
