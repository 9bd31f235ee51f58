"""Grammar libraries side by side (issue #24): ``python -m backend.bench.grammar_libs``.

    python -m backend.bench.grammar_libs [--vocab 1k|32k] [--libs llguidance,xgrammar,...]
                                         [--reps N] [--json OUT]

For each library importable here (llguidance always; a missing one is listed with the pip
pin that installs it), in one run, at the vocabulary's size (``grammar_probes``):

1. per-token mask cost: the matcher walks a valid compact instance of ``MODERATE_SCHEMA``,
   the mask computed into an int32 bitmask row before every token and after the last
   (where the end token must be allowed); p50/p90/p99 over ``--reps`` walks, libraries
   interleaved walk by walk. "first mask" = compile + matcher + first mask of a fresh
   schema (median of 5): what a new schema costs before its first token.
2. a batch of 32 masks, matchers at staggered positions: a loop of per-matcher calls and
   the library's batch API where it has one, alternating which goes first.
3. JSON Schema coverage (``grammar_probes.coverage``): each probe's verdict, from instances
   driven token by token through the real matcher.

llguidance runs with the engine's options (``backend.engine.grammar``: compact JSON; any
warning about an unimplemented keyword refuses the schema, as the engine answers 400).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.metadata
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import llguidance
import torch

from backend.engine.grammar import JSON_DEFAULTS, JSON_OVERRIDES

from . import grammar_probes as probes
from .grammar_probes import IGNORED, OVER, REFUSED, BenchVocab, allowed, bitmask

BATCH = 32
FIRST_MASK_RUNS = 5  # fresh compiles per library; their median is "first mask"


class Adapter(Protocol):
    """One library behind the calls the bench makes; grammars and matchers are opaque."""

    settings: str
    batch_api: str | None

    def compile(self, schema: dict[str, Any]) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fork(self, matcher: Any) -> Any: ...
    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None: ...
    def fill_batch(self, matchers: list[Any], bitmask: torch.Tensor) -> None: ...
    def accept(self, matcher: Any, token: int) -> bool: ...
    def accepts_end(self, matcher: Any) -> bool: ...


class LLGuidance:
    settings = "the engine's: compact JSON, lenient + any warning refuses"
    batch_api: str | None = "LLExecutor (fill_next_token_bitmask_par)"

    def __init__(self, vocab: BenchVocab, threads: int) -> None:
        self.eos = vocab.eos_id
        self.tokenizer = llguidance.LLTokenizer(vocab.tokenizer_json, n_vocab=vocab.size,
                                                eos_token=vocab.eos_id)
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, schema: dict[str, Any]) -> str:
        text = llguidance.LLMatcher.grammar_from_json_schema(schema, JSON_DEFAULTS,
                                                             JSON_OVERRIDES)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            text, self.tokenizer)
        if failed or messages:  # the engine's rule: a warning is a refusal, never a loosening
            raise ValueError("; ".join(messages))
        return text

    def matcher(self, compiled: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, compiled, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fork(self, matcher: llguidance.LLMatcher) -> llguidance.LLMatcher:
        return matcher.deep_copy()

    # llguidance.torch's two fill helpers, inlined: importing that module costs seconds
    # (torch._dynamo, for its compiled apply kernel)
    def fill(self, matcher: llguidance.LLMatcher, bitmask: torch.Tensor, row: int) -> None:
        line = bitmask[row]
        matcher.unsafe_compute_mask_ptr(line.data_ptr(), line.numel() * line.element_size())

    def fill_batch(self, matchers: list[llguidance.LLMatcher], bitmask: torch.Tensor) -> None:
        rows, words = bitmask.shape
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                              bitmask.data_ptr(), words * 4, rows)

    def accept(self, matcher: llguidance.LLMatcher, token: int) -> bool:
        return matcher.consume_token(token)

    def accepts_end(self, matcher: llguidance.LLMatcher) -> bool:
        return matcher.is_accepting() and matcher.consume_token(self.eos)


class XGrammar:
    settings = "compile_json_schema(strict_mode=True, compact separators), cache off"
    batch_api: str | None = "BatchGrammarMatcher"

    def __init__(self, vocab: BenchVocab, threads: int) -> None:
        self.xgr: Any = importlib.import_module("xgrammar")
        transformers: Any = importlib.import_module("transformers")  # an xgrammar dependency
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=vocab.encoder())
        info = self.xgr.TokenizerInfo.from_huggingface(fast, vocab_size=vocab.size,
                                                       stop_token_ids=[vocab.eos_id])
        self.compiler = self.xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.batch = self.xgr.BatchGrammarMatcher(max_threads=threads)
        self.eos = vocab.eos_id

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                 separators=(",", ":"), strict_mode=True)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fork(self, matcher: Any) -> Any:
        return matcher.fork()

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def accepts_end(self, matcher: Any) -> bool:
        return bool(matcher.accept_token(self.eos)) and bool(matcher.is_terminated())


class OutlinesCore:
    settings = "build_regex_from_schema (default whitespace) + Index"
    batch_api: str | None = None

    def __init__(self, vocab: BenchVocab, threads: int) -> None:
        self.oc: Any = importlib.import_module("outlines_core")
        encoder = vocab.encoder()
        special = {t.content for t in encoder.get_added_tokens_decoder().values()}
        byte_of = probes.byte_level_decoder()
        by_bytes: dict[bytes, list[int]] = {}
        for text, token in encoder.get_vocab(with_added_tokens=True).items():
            if text not in special:  # byte-level strings ("Ġ" = space) back to raw bytes
                by_bytes.setdefault(bytes(byte_of[c] for c in text), []).append(token)
        self.vocabulary = self.oc.Vocabulary(vocab.eos_id, by_bytes)

    def compile(self, schema: dict[str, Any]) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fork(self, matcher: Any) -> Any:
        return copy.deepcopy(matcher)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        line = bitmask[row]
        matcher.write_mask_into(line.data_ptr(), line.numel(), line.element_size())

    def fill_batch(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        for row, matcher in enumerate(matchers):
            self.fill(matcher, bitmask, row)

    def accept(self, matcher: Any, token: int) -> bool:
        try:
            matcher.advance(token, return_tokens=False)
        except ValueError:  # "No next state": the token is not allowed
            return False
        return True

    def accepts_end(self, matcher: Any) -> bool:  # advance(eos) raises: the engine stops
        return bool(matcher.is_finished())


@dataclass(slots=True, frozen=True)
class Library:
    name: str
    module: str
    pin: str
    adapter: Callable[[BenchVocab, int], Adapter]

    def version(self) -> str | None:
        """The installed version, or None when the module does not import here."""
        try:
            importlib.import_module(self.module)
            return importlib.metadata.version(self.pin.split("==")[0])
        except ImportError:
            return None
        except importlib.metadata.PackageNotFoundError:
            return "unknown"


LIBRARIES = {lib.name: lib for lib in (
    Library("llguidance", "llguidance", "llguidance==1.9.1", LLGuidance),
    Library("xgrammar", "xgrammar", "xgrammar==0.2.9", XGrammar),
    Library("outlines-core", "outlines_core", "outlines-core==0.2.14", OutlinesCore),
)}


# ---------------------------------------------------------------- masks
def percentiles_us(seconds: list[float]) -> dict[str, float]:
    ranked = sorted(seconds)
    at = {q: round(ranked[min(len(ranked) - 1, int(q * len(ranked)))] * 1e6, 1)
          for q in (.5, .9, .99)}
    return {"p50_us": at[.5], "p90_us": at[.9], "p99_us": at[.99],
            "max_us": round(ranked[-1] * 1e6, 1)}


def _first_mask(adapter: Adapter, size: int) -> tuple[Any, float]:
    """A matcher past its first mask (a template to fork, as the engine keeps one per
    grammar) and the seconds from schema to that mask."""
    began = time.perf_counter()
    matcher = adapter.matcher(adapter.compile(probes.MODERATE_SCHEMA))
    adapter.fill(matcher, bitmask(1, size), 0)
    return matcher, time.perf_counter() - began


def mask_costs(adapters: dict[str, Adapter], vocab: BenchVocab, reps: int
               ) -> dict[str, dict[str, Any]]:
    """Per-token mask times along the moderate instance, libraries interleaved walk by walk."""
    ids = vocab.encode(probes.MODERATE_INSTANCE, vocab.encoder())
    templates, first, samples = {}, {}, {name: list[float]() for name in adapters}
    for name, adapter in adapters.items():
        runs = [_first_mask(adapter, vocab.size) for _ in range(FIRST_MASK_RUNS)]
        templates[name], first[name] = runs[-1][0], statistics.median(t for _, t in runs)
    mask = bitmask(1, vocab.size)
    for _ in range(reps):
        for name, adapter in adapters.items():
            matcher = adapter.fork(templates[name])
            for k, token in enumerate([*ids, vocab.eos_id]):
                began = time.perf_counter()
                adapter.fill(matcher, mask, 0)
                samples[name].append(time.perf_counter() - began)
                taken = k == len(ids) or adapter.accept(matcher, token)
                if not (allowed(mask, 0, token) and taken):
                    raise RuntimeError(f"{name} refused token {k} of the valid instance")
    return {name: {"tokens": len(ids), "samples": len(samples[name]),
                   "first_mask_ms": round(first[name] * 1e3, 2), **percentiles_us(samples[name])}
            for name in adapters}


def batch_cost(adapter: Adapter, vocab: BenchVocab, steps: int) -> dict[str, Any]:
    """Masks for BATCH matchers at staggered positions: a loop of calls, and the batch API."""
    ids = vocab.encode(probes.MODERATE_INSTANCE, vocab.encoder())
    template, _ = _first_mask(adapter, vocab.size)
    positions = [i * len(ids) // BATCH for i in range(BATCH)]
    matchers = [adapter.fork(template) for _ in range(BATCH)]
    for matcher, position in zip(matchers, positions, strict=True):
        for token in ids[:position]:
            adapter.accept(matcher, token)
    mask = bitmask(BATCH, vocab.size)

    def loop() -> None:
        for i, matcher in enumerate(matchers):
            adapter.fill(matcher, mask, i)

    calls: dict[str, Callable[[], None]] = {"loop": loop}
    if adapter.batch_api:
        calls["api"] = lambda: adapter.fill_batch(matchers, mask)
    times: dict[str, list[float]] = {kind: [] for kind in calls}
    for step in range(steps):
        for kind in (list(calls) if step % 2 == 0 else list(calls)[::-1]):
            began = time.perf_counter()
            calls[kind]()
            times[kind].append(time.perf_counter() - began)
        for i in range(BATCH):  # the masks are real: each row allows that matcher's next token
            token = ids[positions[i]] if positions[i] < len(ids) else vocab.eos_id
            if not allowed(mask, i, token):
                raise RuntimeError(f"batch row {i} masked its next token")
            if positions[i] == len(ids):  # finished: the next sequence forks the template
                matchers[i], positions[i] = adapter.fork(template), 0
            else:
                adapter.accept(matchers[i], token)
                positions[i] += 1
    return {"size": BATCH, "steps": steps, "api_name": adapter.batch_api,
            **{kind: percentiles_us(t) for kind, t in times.items()}}


# ---------------------------------------------------------------- report
def _gist(message: str, width: int = 72) -> str:
    text = " ".join(message.split())
    return text if len(text) <= width else text[:width - 1] + "…"


def _quoted(items: list[str]) -> str:
    return ", ".join(f"`{x}`" for x in items)


def _cell(v: dict[str, Any]) -> str:
    kind, quoted = v["verdict"], _quoted
    if kind == REFUSED:
        text = f"refused ({quoted(v['keywords']) or 'names no keyword'}): {_gist(v['message'])}"
    elif kind == IGNORED:
        text = f"**SILENTLY IGNORED**: accepts {quoted(v['accepted_invalid'])}"
        text += f"; refuses valid {quoted(v['refused_valid'])}" if v["refused_valid"] else ""
    elif kind == OVER:
        text = f"over-restrictive: refuses valid {quoted(v['refused_valid'])}"
    else:
        text = f"{kind}: {_gist(v['message'])}" if "message" in v else kind
    text += "; logged to stderr" if v["notes"] else ""
    return text.replace("|", "\\|")


def render(result: dict[str, Any]) -> str:
    libs, vocab, total = result["libraries"], result["vocab"], len(result["coverage"])
    title = (f"# Grammar libraries: vocab {vocab['name']} ({vocab['size']} tokens, "
             f"{vocab['source']}), {result['reps']} reps, {result['threads']} threads")
    out = [title, ""]
    out += [f"- {n} {lib['version']}: {lib['settings']}" if lib["installed"]
            else f"- {n}: not installed: pip install {lib['pin']}" for n, lib in libs.items()]
    tokens = next(iter(result["mask"].values()))["tokens"]
    out += ["", f"## Per-token mask along the moderate instance ({tokens} tokens + end)", "",
            "| library | p50 µs | p90 µs | p99 µs | max µs | first mask ms (compile incl.) |",
            "|---|---|---|---|---|---|"]
    out += [f"| {n} | {m['p50_us']} | {m['p90_us']} | {m['p99_us']} | {m['max_us']} | "
            f"{m['first_mask_ms']} |" for n, m in result["mask"].items()]
    out += ["", f"## A batch of {BATCH} masks (staggered positions), per step", "",
            "| library | loop p50 / p99 µs | batch API | batch API p50 / p99 µs |",
            "|---|---|---|---|"]
    for n, b in result["batch"].items():
        api = f"{b['api']['p50_us']} / {b['api']['p99_us']}" if "api" in b else "n/a"
        out.append(f"| {n} | {b['loop']['p50_us']} / {b['loop']['p99_us']} | "
                   f"{b['api_name'] or 'none'} | {api} |")
    ran = list(result["mask"])
    out += ["", f"## JSON Schema coverage ({total} probes)", "",
            "| probe | " + " | ".join(ran) + " |", "|---" * (len(ran) + 1) + "|"]
    out += [f"| {row['probe']} | " + " | ".join(_cell(row["verdicts"][n]) for n in ran) + " |"
            for row in result["coverage"]]
    counts = result["silently_ignored"].items()
    return "\n".join([*out, "", "SILENTLY IGNORED: " + ", ".join(
        f"{n} {c}/{total}" for n, c in counts)])


def run(vocab_name: str, names: list[str], reps: int, threads: int,
        probe_timeout: float) -> dict[str, Any]:
    vocab = probes.load_vocab(vocab_name)
    libs: dict[str, dict[str, Any]] = {}
    adapters: dict[str, Adapter] = {}
    for name in names:
        lib = LIBRARIES[name]
        version = lib.version()
        libs[name] = {"installed": version is not None, "pin": lib.pin, "version": version}
        if version is not None:
            adapters[name] = lib.adapter(vocab, threads)
            libs[name]["settings"] = adapters[name].settings
    rows = {n: probes.coverage(n, LIBRARIES[n].adapter, vocab, probe_timeout) for n in adapters}
    return {
        "vocab": {"name": vocab.name, "size": vocab.size, "eos_id": vocab.eos_id,
                  "source": vocab.source},
        "reps": reps, "threads": threads, "libraries": libs,
        "mask": mask_costs(adapters, vocab, reps),
        "batch": {n: batch_cost(a, vocab, max(4, 3 * reps)) for n, a in adapters.items()},
        "coverage": [{"probe": p.name, "verdicts": {n: rows[n][i] for n in adapters}}
                     for i, p in enumerate(probes.PROBES)],
        "silently_ignored": {n: sum(r["verdict"] == IGNORED for r in rows[n]) for n in adapters},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.bench.grammar_libs",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", choices=("1k", "32k"), default="1k")
    ap.add_argument("--libs", default=",".join(LIBRARIES),
                    help=f"comma-separated, of {', '.join(LIBRARIES)} (default: all)")
    ap.add_argument("--reps", type=int, default=20, help="walks along the instance (20)")
    ap.add_argument("--threads", type=int, default=min(8, len(os.sched_getaffinity(0))),
                    help="threads of the batch APIs (default: this process's CPUs, ≤ 8)")
    ap.add_argument("--probe-timeout", type=float, default=30.0, metavar="S",
                    help="a coverage probe still compiling after S seconds did not finish")
    ap.add_argument("--json", type=Path, metavar="OUT", help="write the figures here")
    args = ap.parse_args(argv)
    names = list(dict.fromkeys(n.strip() for n in args.libs.split(",") if n.strip()))
    if not names or any(n not in LIBRARIES for n in names):
        ap.error(f"--libs: choose from {', '.join(LIBRARIES)}")
    if args.reps < 1 or args.threads < 1:
        ap.error("--reps and --threads must be ≥ 1")
    if all(LIBRARIES[n].version() is None for n in names):
        ap.error(f"none of {', '.join(names)} is installed")
    result = run(args.vocab, names, args.reps, args.threads, args.probe_timeout)
    print(render(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
