"""Constrained decoding against free text, side by side: ``python -m backend.bench.structured``.

One engine (the bench model, ``checkpoint.FULL_MODEL`` in bf16; ``--model tiny``: the
bundled tiny model, whose forward is so cheap that it is the worst case for per-step
overhead) serves, in one process:

* **throughput**: at batch 1 and 32 (``--batches``), requests constrained by a JSON Schema
  (``SCHEMA``: an object of bounded strings, integers, an enum, arrays and a nested
  object) against free-text requests of the same lengths. A calibration run of the
  constrained requests (greedy by default) records each one's output token count; the
  free-text request with the same prompt then gets exactly that ``max_tokens`` with
  ``ignore_eos``, and both carry the same logit bias (``closing_bias``: random weights
  never close a JSON string unless the closing tokens are favoured), so the two differ in
  the grammar alone. A run at batch b serves ``max(b, --min-requests)`` requests in
  waves of b arriving together; tokens/s = output tokens ÷ first arrival to last
  finish. ``--rounds`` rounds alternate which arm goes first; a ratio is the median of
  per-round ratios (this VM's speed drifts ±40 %), a rate the median over rounds. Every
  timed run must reproduce the calibration's counts (else it fails loudly).
* **what stays behind**: free-text runs (``SENTINEL_TOKENS`` a request) at each batch
  before any constrained step and again after them all: tokens/s after ÷ before and the
  forward time (requests without constraints should pay nothing, then or later).
* **mask time per step** (constrained runs): the engine's own ``mask_seconds`` (from the
  mask job's start, before the forward, to its application: it includes the overlap with
  the forward), and from probes the bench puts around ``Masker._forbidden``,
  ``MaskJob.apply`` and ``runner.execute`` for its runs only (never in engine code): the
  worker's compute time, how long the step thread waited for it after the forward, the
  ``masked_fill_``, and the forward of both arms (on 2 cores a mask computed "beside" the
  forward still takes a core from it).
* **compile time** (check + first mask, ``compile_seconds``) over ``--compile-schemas``
  distinct schemas at each of 2-32 properties, on a fresh ``GrammarCompiler``; the
  first-request latency (add to first token, alone) with a new schema, the same schema
  again (cached) and free text; and the cache hit rate of ``--cache-requests`` requests
  over ``--cache-schemas`` distinct schemas new to the engine (hits ÷ (hits + compiles),
  from the engine's counters: with no eviction, 1 - distinct ÷ requests).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from backend.engine.builder import EngineParts, build_engine
from backend.engine.config import EngineConfig
from backend.engine.grammar import GrammarCompiler
from backend.engine.grammar_masks import Masker, MaskJob
from backend.engine.sampling import GrammarSpec, SamplingParams
from modelfiles.tokenizer import Tokenizer

from .checkpoint import FULL_MODEL, QUICK_MODEL, TEST_MODEL, write_checkpoint
from .structured_report import TARGETS, format_table, pct

MODELS = {"full": FULL_MODEL, "quick": QUICK_MODEL, "test": TEST_MODEL}
MAX_TOKENS = 400  # a constrained request's cap; SCHEMA's instances end well before it
SENTINEL_TOKENS = 64  # per request in the free-text runs before and after everything

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "city": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "integer", "minimum": -1000, "maximum": 1000},
        "status": {"enum": ["active", "inactive", "pending"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                 "maxItems": 4},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4},
        "address": {"type": "object", "properties": {
            "street": {"type": "string", "maxLength": 16},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "zip"], "additionalProperties": False},
    },
    "required": ["name", "city", "age", "score", "status", "tags", "flags", "address"],
    "additionalProperties": False,
}


def closing_bias(tokenizer: Tokenizer, bias: float = 8.0) -> tuple[tuple[int, float], ...]:
    """A logit bias toward the tokens that only close (a quote, ``]``, ``}``, the end of
    sequence): a trained model's wish to close what it opened, which random weights lack
    (tests/backend/engine/schemas.py adds a weaker comma)."""
    ids = [i for i in range(tokenizer.vocab_size)
           if (s := tokenizer.decode([i])) and set(s) <= set('"]}')]
    ids += [i for i in tokenizer.eos_token_ids if i not in ids]
    return tuple((i, bias) for i in ids)


def sized_schema(properties: int, salt: int) -> dict[str, Any]:
    """A distinct object schema of ``properties`` properties of varied kinds."""
    kinds: list[Callable[[int], dict[str, Any]]] = [
        lambda i: {"type": "string", "maxLength": 8 + i % 24},
        lambda i: {"type": "integer", "minimum": -i, "maximum": 100 + i},
        lambda i: {"enum": [f"v{i}_{k}" for k in range(3 + i % 4)]},
        lambda i: {"type": "array", "items": {"type": "string", "maxLength": 6},
                   "maxItems": 2 + i % 4},
        lambda i: {"type": "boolean"},
        lambda i: {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": 0, "maximum": i + 9},
            "y": {"type": "string", "pattern": f"^[a-z]{{1,{2 + i % 5}}}$"}},
            "required": ["x", "y"], "additionalProperties": False},
        lambda i: {"type": "number", "minimum": -i},
    ]
    props = {f"p{salt}_{i}": kinds[(i + salt) % len(kinds)](i + salt)
             for i in range(properties)}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def json_spec(schema: dict[str, Any]) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema))


@dataclass(slots=True)
class Probe:
    """Per step, in seconds: the model's forward (``runner.execute``), and for
    constrained steps the worker's mask compute, the step thread's wait for it after the
    forward, and the apply (``masked_fill_``)."""

    forward: list[float] = field(default_factory=list)
    compute: list[float] = field(default_factory=list)
    wait: list[float] = field(default_factory=list)
    apply: list[float] = field(default_factory=list)
    ready: int = 0  # steps whose masks were done before the forward was

    def clear(self) -> None:
        for xs in (self.forward, self.compute, self.wait, self.apply):
            xs.clear()
        self.ready = 0


@contextlib.contextmanager
def probing(runner: Any, clock: Callable[[], float] = time.perf_counter) -> Iterator[Probe]:
    """Time the engine's steps from outside: wraps ``runner.execute``,
    ``Masker._forbidden`` and ``MaskJob.apply`` while the block runs, then puts the
    originals back (the engine's code is never changed for the bench)."""
    probe = Probe()
    execute, forbidden, apply = runner.execute, Masker._forbidden, MaskJob.apply

    def timed_execute(*a: Any, **kw: Any) -> torch.Tensor:
        began = clock()
        out = execute(*a, **kw)
        probe.forward.append(clock() - began)
        return out  # type: ignore[no-any-return]

    def timed_forbidden(masker: Masker, matchers: Any) -> torch.Tensor:
        began = clock()
        out = forbidden(masker, matchers)
        probe.compute.append(clock() - began)
        return out

    def timed_apply(job: MaskJob, logits: torch.Tensor) -> torch.Tensor:
        probe.ready += job._future.done()
        began = clock()
        job._future.result()
        waited = clock()
        out = apply(job, logits)
        probe.wait.append(waited - began)
        probe.apply.append(clock() - waited)
        return out

    with mock.patch.object(runner, "execute", timed_execute), \
            mock.patch.object(Masker, "_forbidden", timed_forbidden), \
            mock.patch.object(MaskJob, "apply", timed_apply):
        yield probe


@dataclass(slots=True)
class Run:
    tokens: int
    seconds: float
    steps: int
    counts: list[int]  # output tokens per request, in prompt order
    forward_ms: float = float("nan")  # median runner.execute time, when probed

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def step_ms(self) -> float:
        return self.seconds / self.steps * 1e3


class Bench:
    """One engine and the bench's workloads on it."""

    def __init__(self, parts: EngineParts, args: argparse.Namespace) -> None:
        self.parts = parts
        self.core = parts.core
        grammars = self.core.grammars
        if grammars is None:
            raise RuntimeError("this engine serves no constrained decoding")
        self.grammars = grammars
        self.args = args
        self.bias = closing_bias(parts.tokenizer)
        self.rng = random.Random(args.seed)
        self._ids = 0

    def prompts(self, n: int) -> list[list[int]]:
        vocab = self.parts.tokenizer.vocab_size
        return [[self.rng.randrange(4, vocab) for _ in range(self.args.prompt)]
                for _ in range(n)]

    def constrained(self, spec: GrammarSpec, max_tokens: int = MAX_TOKENS) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=self.args.temperature,
                              seed=self.args.seed, grammar=spec, logit_bias=self.bias)

    def free(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=self.args.temperature,
                              seed=self.args.seed, ignore_eos=True, logit_bias=self.bias)

    def serve(self, prompts: list[list[int]], params: list[SamplingParams], wave: int) -> Run:
        """Serve the requests in waves of ``wave`` arriving together, one wave after the
        other; their output counts in order."""
        core = self.core
        counts: dict[str, int] = {}
        ids: list[str] = []
        steps = 0
        start = core.clock()
        for w in range(0, len(prompts), wave):
            for prompt, p in zip(prompts[w:w + wave], params[w:w + wave]):
                self._ids += 1
                ids.append(f"r{self._ids}")
                core.add_request(ids[-1], prompt, p)
            while core.has_work():
                steps += 1
                for d in core.step():
                    if d.finished:
                        counts[d.request_id] = d.num_output_tokens
        end = core.clock()
        out = [counts[i] for i in ids]
        return Run(sum(out), end - start, steps, out)

    def first_token(self, prompt: list[int], params: SamplingParams) -> float:
        """Seconds from add_request (which compiles a new grammar) to the first token."""
        core = self.core
        self._ids += 1
        rid = f"r{self._ids}"
        began = core.clock()
        core.add_request(rid, prompt, params)
        first: float | None = None
        while core.has_work():
            for d in core.step():
                if first is None and d.request_id == rid and d.token_ids:
                    first = core.clock()
        if first is None:
            raise RuntimeError(f"{rid} produced no token")
        return first - began

    # ---- 1 and 2: throughput and mask time --------------------------------------------
    def throughput(self, progress: Callable[[str], None]) -> tuple[dict[str, Any],
                                                                    dict[str, Any]]:
        args, stats = self.args, self.grammars.stats
        spec = json_spec(SCHEMA)
        arms: dict[int, dict[str, list[SamplingParams]]] = {}
        prompts = {b: self.prompts(max(b, args.min_requests)) for b in args.batches}
        counts: dict[int, list[int]] = {}
        before = self.unconstrained(prompts, warm=True)  # before any constrained step
        for b in args.batches:
            json_params = [self.constrained(spec)] * len(prompts[b])
            counts[b] = self.serve(prompts[b], json_params, b).counts  # calibration
            arms[b] = {"json": json_params, "free": [self.free(n) for n in counts[b]]}
            self.serve(prompts[b], arms[b]["free"], b)  # warm-up of the free path
            progress(f"batch {b}: {len(prompts[b])} requests, output tokens "
                     f"{min(counts[b])}-{max(counts[b])} (median {statistics.median(counts[b])})")
        runs = {b: {"json": list[Run](), "free": list[Run]()} for b in args.batches}
        masks = {b: {k: list[float]() for k in ("engine", "compute", "wait", "apply")}
                 for b in args.batches}
        ready = dict.fromkeys(args.batches, 0)
        with probing(self.parts.runner) as probe:
            for r in range(args.rounds):
                for b in args.batches:
                    for arm in ("json", "free") if r % 2 == 0 else ("free", "json"):
                        stats.mask_seconds.clear()
                        probe.clear()
                        run = self.serve(prompts[b], arms[b][arm], b)
                        if run.counts != counts[b]:  # same lengths, or the ratio means nothing
                            raise RuntimeError(f"{arm}: output counts {run.counts} differ "
                                               f"from the calibration's {counts[b]}")
                        run.forward_ms = pct(probe.forward, 0.5) * 1e3
                        runs[b][arm].append(run)
                        if arm == "json":
                            m = masks[b]
                            m["engine"] += stats.mask_seconds
                            m["compute"] += probe.compute
                            m["wait"] += probe.wait
                            m["apply"] += probe.apply
                            ready[b] += probe.ready
                    j, f = runs[b]["json"][-1], runs[b]["free"][-1]
                    progress(f"round {r + 1}/{args.rounds} batch {b:2}: json "
                             f"{j.tokens_per_s:8.1f} tok/s, free {f.tokens_per_s:8.1f} tok/s, "
                             f"ratio {j.tokens_per_s / f.tokens_per_s:.3f}")
        after = self.unconstrained(prompts, warm=False)
        throughput: dict[str, Any] = {}
        mask: dict[str, Any] = {}
        for b in args.batches:
            js, fs = runs[b]["json"], runs[b]["free"]
            ratios = [j.tokens_per_s / f.tokens_per_s for j, f in zip(js, fs)]
            throughput[str(b)] = {
                "tokens_per_s_ratio": statistics.median(ratios),
                "round_ratios": ratios,
                "tokens_per_s": statistics.median(j.tokens_per_s for j in js),
                "free_tokens_per_s": statistics.median(f.tokens_per_s for f in fs),
                # mean step (run time ÷ steps) and median forward, median over rounds
                "step_ms": statistics.median(j.step_ms for j in js),
                "free_step_ms": statistics.median(f.step_ms for f in fs),
                "forward_ms": statistics.median(j.forward_ms for j in js),
                "free_forward_ms": statistics.median(f.forward_ms for f in fs),
                "requests": len(counts[b]),
                "output_tokens_min": min(counts[b]),
                "output_tokens_median": statistics.median(counts[b]),
                "output_tokens_max": max(counts[b]),
                # the same free-text runs before any constrained step and after them all
                "unconstrained_after_over_before": statistics.median(
                    a.tokens_per_s for a in after[b]) / statistics.median(
                    x.tokens_per_s for x in before[b]),
                "unconstrained_forward_ms_before": statistics.median(
                    x.forward_ms for x in before[b]),
                "unconstrained_forward_ms_after": statistics.median(
                    a.forward_ms for a in after[b]),
            }
            m = masks[b]
            mask[str(b)] = {"steps": len(m["engine"]),
                            "ready_before_forward_end": ready[b] / max(1, len(m["wait"]))}
            for key, xs in m.items():
                mask[str(b)][f"{key}_ms_p50"] = pct(xs, 0.5) * 1e3
                mask[str(b)][f"{key}_ms_p99"] = pct(xs, 0.99) * 1e3
        return throughput, mask

    def unconstrained(self, prompts: dict[int, list[list[int]]],
                      warm: bool) -> dict[int, list[Run]]:
        """``--sentinel-runs`` free-text runs per batch (``SENTINEL_TOKENS`` tokens a
        request), forward timed: run before any constrained step and after them all, they
        show whether constrained decoding leaves a cost behind for requests without one."""
        out: dict[int, list[Run]] = {}
        with probing(self.parts.runner) as probe:
            for b, batch in prompts.items():
                params = [self.free(SENTINEL_TOKENS)] * len(batch)
                if warm:
                    self.serve(batch, params, b)
                out[b] = []
                for _ in range(self.args.sentinel_runs):
                    probe.clear()
                    run = self.serve(batch, params, b)
                    run.forward_ms = pct(probe.forward, 0.5) * 1e3
                    out[b].append(run)
        return out

    # ---- 3: compile time, first-request latency, cache hit rate ----------------------
    def compile_times(self) -> dict[str, Any]:
        args = self.args
        fresh = GrammarCompiler.for_tokenizer(self.parts.tokenizer,
                                              self.parts.model_config.vocab_size,
                                              tuple(self.core.eos_token_ids))
        by_size: dict[str, list[float]] = {}
        for size in args.compile_sizes:
            for k in range(args.compile_schemas):
                fresh.matcher(json_spec(sized_schema(size, 1000 + 100 * size + k)))
                by_size.setdefault(str(size), []).append(fresh.stats.compile_seconds[-1])
        every = [x for xs in by_size.values() for x in xs]
        # first-request latency, alone: a new schema, then the same one, then free text
        new, cached, free = [], [], []
        for k in range(args.first_requests):
            prompt = self.prompts(1)[0]
            spec = json_spec(sized_schema(8, 5000 + k))
            new.append(self.first_token(prompt, self.constrained(spec, 2)))
            cached.append(self.first_token(prompt, self.constrained(spec, 2)))
            free.append(self.first_token(prompt, self.free(2)))
        return {
            "schemas": len(every),
            "compile_ms_p50": pct(every, 0.5) * 1e3,
            "compile_ms_p99": pct(every, 0.99) * 1e3,
            "compile_ms_p50_by_properties": {s: pct(xs, 0.5) * 1e3
                                             for s, xs in by_size.items()},
            "schema_bytes_by_properties": {
                str(s): len(json.dumps(sized_schema(s, 1000 + 100 * s)))
                for s in args.compile_sizes},
            "first_request_ttft_ms": statistics.median(new) * 1e3,
            "cached_schema_ttft_ms": statistics.median(cached) * 1e3,
            "free_ttft_ms": statistics.median(free) * 1e3,
        }

    def cache_hit_rate(self) -> dict[str, Any]:
        """``--cache-requests`` requests over ``--cache-schemas`` schemas new to the
        engine, in a seeded shuffled order; the engine's own counters before and after."""
        args, stats = self.args, self.grammars.stats
        specs = [json_spec(sized_schema(4 + k % 5, 9000 + k)) for k in range(args.cache_schemas)]
        order = [specs[i % len(specs)] for i in range(args.cache_requests)]
        self.rng.shuffle(order)
        compiles, hits = stats.compiles, stats.cache_hits
        prompts = self.prompts(len(order))
        for w in range(0, len(order), 32):
            self.serve(prompts[w:w + 32], [self.constrained(s, 1) for s in order[w:w + 32]],
                       32)
        compiles, hits = stats.compiles - compiles, stats.cache_hits - hits
        return {"requests": len(order), "distinct_schemas": len(specs), "compiles": compiles,
                "cache_hits": hits, "hit_rate": hits / (hits + compiles)}


def build(args: argparse.Namespace, tmp: Path) -> EngineParts:
    if args.model == "tiny":
        return build_engine(EngineConfig(model="tiny", device=args.device,
                                         dtype=args.dtype or "auto",
                                         enable_prefix_cache=False))
    path = write_checkpoint(tmp / "model", MODELS[args.model],
                            getattr(torch, args.dtype or "bfloat16"))
    return build_engine(EngineConfig(model=str(path), device=args.device,
                                     dtype=args.dtype or "bfloat16", kv_memory_gib=0.25,
                                     enable_prefix_cache=False))


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="sluice-structured-") as tmp:
        parts = build(args, Path(tmp))
        bench = Bench(parts, args)
        throughput, mask = bench.throughput(progress)
        compile_ = bench.compile_times()
        cache = bench.cache_hit_rate()
    return {
        "throughput": throughput, "mask": mask, "compile": compile_, "cache": cache,
        "details": {"model": args.model, "dtype": str(parts.dtype).removeprefix("torch."),
                    "device": str(parts.device), "vocab_size": parts.model_config.vocab_size,
                    "threads": torch.get_num_threads(), "prompt_len": args.prompt,
                    "temperature": args.temperature, "rounds": args.rounds,
                    "schema": SCHEMA, "targets": TARGETS},
    }


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.bench.structured", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=(*sorted(MODELS), "tiny"), default="full")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="default bfloat16 (tiny: the engine's default, float32 on CPU)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", type=_ints, default=[1, 32])
    ap.add_argument("--min-requests", type=int, default=None,
                    help="requests per run at least (batch 1: this many one after another); "
                         "default 8, 96 on tiny (its runs are ~20x shorter)")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens (random ids)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy (default); > 0: sampled, seeded (--seed)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sentinel-runs", type=int, default=2,
                    help="free-text runs per batch before any constrained step and after")
    ap.add_argument("--compile-sizes", type=_ints, default=[2, 4, 8, 16, 32],
                    help="properties per schema in the compile set")
    ap.add_argument("--compile-schemas", type=int, default=4, help="schemas per size")
    ap.add_argument("--first-requests", type=int, default=5)
    ap.add_argument("--cache-requests", type=int, default=200)
    ap.add_argument("--cache-schemas", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, metavar="FILE", help="also write the figures here")
    args = ap.parse_args(argv)
    if args.min_requests is None:
        args.min_requests = 96 if args.model == "tiny" else 8
    if min(args.min_requests, args.prompt, args.rounds, args.sentinel_runs,
           args.compile_schemas,
           args.first_requests, args.cache_requests, args.cache_schemas,
           *args.batches, *args.compile_sizes) < 1:
        ap.error("counts, sizes and batches must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)

    def progress(m: str) -> None:
        print(f"[structured] {m}", file=sys.stderr, flush=True)

    result = run(args, progress)
    print(format_table(result))
    if args.json:
        args.json.write_text(json.dumps({**result, "settings": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}},
            indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
