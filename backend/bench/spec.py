"""Speculative decoding against plain decoding, side by side: ``python -m backend.bench.spec``.

The bench model (``checkpoint.FULL_MODEL``, bf16; ``--quick``: the 7M one) is served by
engines built in one process from the same checkpoint: plain, n-gram speculation and
draft-model speculation (the draft is the bench model's first ``--draft-layers`` layers
with its embedding, final norm and head, written next to it: it shares the tokenizer and
vocabulary), each drafter at the default batch threshold (``speculative_max_batch``) and
forced at every batch (threshold 64), so the table shows both what a user gets and where
the gain ends.

Two workloads, ``--prompt``-token prompts and ``--output`` tokens each (``ignore_eos``):

* **repetitive** (the n-gram drafter): each prompt repeats a motif of 8-24 random ids;
* **free text** (the draft model): random ids.

At batch 1, 8 and 32 (``--batches``) every engine serves the same batch, all requests
arriving together. Per run: output tokens/s (all output ÷ first arrival to last finish),
TPOT (mean over requests of (finish - first token) ÷ (tokens - 1)), TTFT, and from the
engine's counters the drafts proposed and accepted, the acceptance rate, tokens per
verifying sequence-step and the share of the run spent drafting. ``--rounds`` rounds run
every engine once per cell in a rotating order; a ratio is the median over rounds of that
round's ratio (this VM's speed drifts), a rate the median over rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from backend.engine.builder import EngineParts, build_engine
from backend.engine.config import EngineConfig
from backend.engine.outputs import OutputDelta
from backend.engine.sampling import SamplingParams
from backend.engine.spec import SpecStats

from .checkpoint import FULL_MODEL, QUICK_MODEL, TEST_MODEL, write_checkpoint

FORCED = 64  # a threshold above every batch: speculate always
MODELS = {"full": FULL_MODEL, "quick": QUICK_MODEL, "test": TEST_MODEL}


@dataclass(slots=True)
class Run:
    tokens_per_s: float
    tpot_s: float
    ttft_s: float
    spec: SpecStats  # the engine's counters over this run
    draft_share: float  # of the run's wall time

    @property
    def acceptance(self) -> float:
        return self.spec.acceptance_rate

    @property
    def tokens_per_step(self) -> float:
        return self.spec.tokens_per_step or 1.0  # 1: no step verified drafts


def write_draft(target: Path, out: Path, layers: int) -> Path:
    """The target's first ``layers`` layers, embedding, final norm and head, as a checkpoint."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(target / "model.safetensors"))
    keep = {k: v for k, v in tensors.items() if not k.startswith("model.layers.")
            or int(k.split(".")[2]) < layers}
    save_file(keep, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in target.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (out / f.name).write_bytes(f.read_bytes())
    return out


def prompts(kind: str, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if kind == "repetitive":
            motif = [rng.randrange(4, 1024) for _ in range(rng.randint(8, 24))]
            out.append((motif * (length // len(motif) + 1))[:length])
        else:
            out.append([rng.randrange(4, 1024) for _ in range(length)])
    return out


def serve(parts: EngineParts, batch: list[list[int]], output: int, temperature: float,
          tag: str) -> Run:
    core = parts.core
    before = dataclasses.replace(core.spec_stats)
    params = SamplingParams(max_tokens=output, temperature=temperature, ignore_eos=True)
    start = core.clock()
    for i, prompt in enumerate(batch):
        core.add_request(f"{tag}-{i}", prompt, params, arrival_time=start)
    finals: dict[str, OutputDelta] = {}
    while core.has_work():
        for d in core.step():
            if d.finished:
                finals[d.request_id] = d
    end = core.clock()
    after = core.spec_stats
    spec = SpecStats(after.proposed - before.proposed, after.accepted - before.accepted,
                     after.verified - before.verified, after.emitted - before.emitted,
                     after.draft_seconds - before.draft_seconds)
    tpots, ttfts, tokens = [], [], 0
    for d in finals.values():
        m = d.metrics
        assert m is not None and m.first_token_time is not None and m.finished_time is not None
        if d.num_output_tokens != output:
            raise RuntimeError(f"{d.request_id}: {d.num_output_tokens} of {output} tokens")
        tokens += d.num_output_tokens
        tpots.append((m.finished_time - m.first_token_time) / (output - 1))
        ttfts.append(m.first_token_time - m.arrival_time)
    return Run(tokens / (end - start), statistics.mean(tpots), statistics.median(ttfts),
               spec, spec.draft_seconds / (end - start))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.bench.spec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the 7M model, one round")
    ap.add_argument("--model", choices=tuple(MODELS), default=None,
                    help="the bench model (default full; quick with --quick)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy (default); > 0: unseeded sampling")
    ap.add_argument("--rounds", type=int, default=None, help="default 3 (1 with --quick)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = args.rounds or (1 if args.quick else 3)
    batches = [int(b) for b in args.batches.split(",")]
    spec_model = MODELS[args.model or ("quick" if args.quick else "full")]
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory(prefix="sluice-spec-") as tmp:
        target = write_checkpoint(Path(tmp) / "target", spec_model, dtype)
        draft = write_draft(target, Path(tmp) / "draft", args.draft_layers)
        base = {"model": str(target), "device": args.device, "dtype": args.dtype,
                "kv_memory_gib": 0.25, "num_speculative_tokens": args.k}
        engines = {
            "plain": build_engine(EngineConfig(**base)),
            "ngram": build_engine(EngineConfig(**base, speculative="ngram")),
            "ngram-forced": build_engine(EngineConfig(**base, speculative="ngram",
                                                      speculative_max_batch=FORCED)),
            "draft": build_engine(EngineConfig(**base, speculative=f"draft:{draft}")),
            "draft-forced": build_engine(EngineConfig(**base, speculative=f"draft:{draft}",
                                                      speculative_max_batch=FORCED)),
        }
        cells = [("repetitive", "ngram"), ("free", "draft")]
        for name, parts in engines.items():  # warm-up: first-call costs are not measured
            for b in batches:
                serve(parts, prompts("repetitive", b, args.prompt, 99), 8, args.temperature,
                      f"warm-{name}-{b}")
        results: dict[str, dict[str, dict[str, list[Run]]]] = {}
        for r in range(rounds):
            for kind, method in cells:
                for b in batches:
                    batch = prompts(kind, b, args.prompt, seed=1000 * b + r)
                    order = ["plain", method, f"{method}-forced"]
                    order = order[r % 3:] + order[:r % 3]
                    for name in order:
                        run = serve(engines[name], batch, args.output, args.temperature,
                                    f"{kind}-{b}-{r}")
                        results.setdefault(kind, {}).setdefault(str(b), {}) \
                            .setdefault(name, []).append(run)
                        print(f"round {r} {kind:10} batch {b:2} {name:12} "
                              f"{run.tokens_per_s:8.1f} tok/s  TPOT {run.tpot_s * 1e3:6.2f} ms"
                              f"  accept {run.acceptance:.2f}", file=sys.stderr)
        figures = summarize(results, cells)
    print(render(figures, args))
    if args.json:
        Path(args.json).write_text(json.dumps({"figures": figures, "settings": vars(args)},
                                              indent=2))
    return 0


def summarize(results: dict[str, dict[str, dict[str, list[Run]]]],
              cells: list[tuple[str, str]]) -> dict[str, Any]:
    """Per workload, batch and speculating engine: median ratios to plain, and figures."""
    out: dict[str, Any] = {}
    for kind, method in cells:
        for b, runs in results[kind].items():
            plain = runs["plain"]
            for name in (method, f"{method}-forced"):
                mine = runs[name]
                out.setdefault(f"{kind}:{name}", {})[b] = {
                    "tokens_per_s_ratio": statistics.median(
                        s.tokens_per_s / p.tokens_per_s for s, p in zip(mine, plain)),
                    "tpot_ratio": statistics.median(
                        s.tpot_s / p.tpot_s for s, p in zip(mine, plain)),
                    "tokens_per_s": statistics.median(s.tokens_per_s for s in mine),
                    "plain_tokens_per_s": statistics.median(p.tokens_per_s for p in plain),
                    "tpot_ms": statistics.median(s.tpot_s for s in mine) * 1e3,
                    "plain_tpot_ms": statistics.median(p.tpot_s for p in plain) * 1e3,
                    "ttft_ms": statistics.median(s.ttft_s for s in mine) * 1e3,
                    "plain_ttft_ms": statistics.median(p.ttft_s for p in plain) * 1e3,
                    "acceptance_rate": statistics.median(s.acceptance for s in mine),
                    "tokens_per_step": statistics.median(s.tokens_per_step for s in mine),
                    "draft_share": statistics.median(s.draft_share for s in mine),
                }
    return out


def render(figures: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [(f"speculative decoding vs plain, {args.dtype}, K={args.k}, "
             f"temperature {args.temperature}, prompt {args.prompt}, output {args.output}"),
             (f"{'workload:engine':24} {'batch':>5} {'tok/s':>8} {'plain':>8} {'ratio':>6} "
             f"{'TPOT ms':>8} {'plain':>7} {'ratio':>6} {'accept':>6} {'tok/step':>8} "
             f"{'draft%':>6}")]
    for cell, by_batch in figures.items():
        for b, f in by_batch.items():
            lines.append(
                f"{cell:24} {b:>5} {f['tokens_per_s']:8.1f} {f['plain_tokens_per_s']:8.1f} "
                f"{f['tokens_per_s_ratio']:6.2f} {f['tpot_ms']:8.2f} {f['plain_tpot_ms']:7.2f} "
                f"{f['tpot_ratio']:6.2f} {f['acceptance_rate']:6.2f} "
                f"{f['tokens_per_step']:8.2f} {f['draft_share'] * 100:6.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
