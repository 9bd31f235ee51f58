"""The prepared device check: ``scripts/gpu-check.sh`` runs ``python -m
backend.bench.gpu_check --out $OUT`` on one GPU and writes ``$OUT/gpu-check.json``.

Sections, each timed, each written to the JSON as it ends, and each recorded even when
another fails (its ``error``); a ``preflight`` on a small model comes first, and nothing
else runs if it fails:

- ``parity``: the engine against ``transformers`` on the same random ~0.44B Llama
  checkpoint written locally (nothing downloaded), in bf16: each prompt's last-position
  logits (max |difference|, top-1 agreement) and greedy tokens (agreement up to the first
  difference, which bf16 rounding may move).
- ``syncs``: decode steps of greedy and sampled rows (seeded, top-k/p, min-p, penalties,
  bias) under ``torch.cuda.set_sync_debug_mode("warn")``: the host syncs the driver
  reports per step (the device sampler's one ids copy is the target), and
  ``host_sync.count_host_syncs``'s count of the same steps.
- ``roofline``: the decode step (``LLMEngine.step()``, ~0.44B model, context ~512) at
  batch 1, 8, 32 and 128, with CUDA graphs and without, each over the HBM roofline
  measured in the same run (``backend/bench/roofline.py``).
- ``bench``: ``python -m backend.bench --device cuda --dtype bfloat16`` (the engine
  against ``transformers`` ``generate`` on the mixed workload), its JSON kept beside.

On a CPU (``--device cpu --model test``) it runs the same code on a small model in seconds
(``tests/backend/bench/test_gpu_check.py``): a wrong script is found before device time is
spent on it.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from backend.engine.builder import EngineParts, build_engine
from backend.engine.config import EngineConfig
from backend.engine.host_sync import count_host_syncs
from backend.engine.sampling import SamplingParams

from .checkpoint import TEST_MODEL, ModelSpec, write_checkpoint
from .hf_baseline import load_hf_model
from .roofline import decode_step_rounds, measure_machine, roofline_s, sync_device
from .serving import bench_params

# ~0.44B parameters (0.38B in matmuls): the "~0.5B random Llama config"
HALF_B = ModelSpec(hidden_size=1024, num_layers=24, num_heads=16, num_kv_heads=8,
                   intermediate_size=4096, vocab_size=32000, max_positions=4096)
MODELS = {"0.5b": HALF_B, "test": TEST_MODEL}
BATCHES = (1, 8, 32, 128)
JSON_NAME = "gpu-check.json"


def engine(path: Path, device: str, dtype: str, graphs: bool, max_seqs: int) -> EngineParts:
    # batch 128 at context ~530 of the 0.44B model needs ~3.2 GiB (0.75 MiB a 16-token
    # block); 8 GiB leaves room for the prefill's chunks
    kv = 8.0 if device.startswith("cuda") else 0.25
    return build_engine(EngineConfig(model=str(path), device=device, dtype=dtype,
                                     max_num_seqs=max_seqs, max_num_batched_tokens=2048,
                                     cuda_graphs=graphs, kv_memory_gib=kv))


def parity(path: Path, device: torch.device, dtype: str, prompts: int,
           tokens: int) -> dict[str, Any]:
    parts = engine(path, str(device), dtype, True, 16)
    vocab = parts.model_config.vocab_size
    batch = [[(7 + 31 * i + 17 * j) % (vocab - 4) + 4 for j in range(24 + 9 * i)]
             for i in range(prompts)]
    core = parts.core
    for i, ids in enumerate(batch):
        core.add_request(f"p{i}", ids, bench_params(tokens))
    ours: dict[str, list[int]] = {f"p{i}": [] for i in range(prompts)}
    while core.has_work():
        for d in core.step():
            ours[d.request_id].extend(d.token_ids)
    runner = parts.runner
    specs = []
    flat: list[int] = []
    bm = core.block_manager
    at = 0
    for ids in batch:  # a fresh forward over each prompt (all blocks free now), host logits
        n = -(-len(ids) // bm.block_size)
        specs.append((list(range(at, at + n)), 0, len(ids)))
        at += n
        flat.extend(ids)
    ours_logits = runner.run(flat, specs, list(range(prompts)))
    hf = load_hf_model(path, parts.dtype, device)
    theirs_logits = []
    theirs: list[list[int]] = []
    with torch.inference_mode():
        for ids in batch:
            x = torch.tensor([ids], device=device)
            theirs_logits.append(hf(x).logits[0, -1].float().cpu())
            out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x),
                              max_new_tokens=tokens, min_new_tokens=tokens,
                              do_sample=False, pad_token_id=0)
            theirs.append(out[0, len(ids):].tolist())
    diff = (ours_logits - torch.stack(theirs_logits)).abs()
    agree = []
    for i in range(prompts):
        a, b = ours[f"p{i}"], theirs[i]
        n = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        agree.append(n)
    del hf
    return {
        "prompts": prompts, "tokens": tokens, "dtype": dtype,
        "logits_max_abs_diff": float(diff.max()),
        "logits_scale": float(torch.stack(theirs_logits).abs().max()),
        "top1_agree": sum(int(ours_logits[i].argmax() == theirs_logits[i].argmax())
                          for i in range(prompts)) / prompts,
        "greedy_tokens_before_first_difference": agree,
        "greedy_identical": sum(n == tokens for n in agree),
    }


MIXED = [  # the device sampler's every stage: seeded rows, top-k/p, min-p, penalties, bias
    SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=1, ignore_eos=True),
    SamplingParams(temperature=1.0, min_p=0.05, seed=2, ignore_eos=True),
    SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3,
                   logit_bias=((7, 2.0),), ignore_eos=True),
]


def sync_counts(path: Path, device: torch.device, dtype: str, batch: int,
                steps: int) -> dict[str, Any]:
    """Decode steps of greedy and sampled rows (every stage of the device sampler)."""
    parts = engine(path, str(device), dtype, True, max(batch, 8))
    core = parts.core
    for i in range(batch):
        params = bench_params(steps + 8) if i % 2 == 0 else replace(
            MIXED[i // 2 % len(MIXED)], max_tokens=steps + 8)
        core.add_request(f"s{i}", [5 + i] * 16, params)
    for _ in range(4):  # prefill, then every row decodes
        core.step()
    driver: list[int] = []
    ours: list[int] = []
    for _ in range(steps):
        sync_device(device)
        with warnings.catch_warnings(record=True) as seen, count_host_syncs() as calls:
            warnings.simplefilter("always")
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            try:
                core.step()
            finally:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
        driver.append(sum("synchroniz" in str(w.message) for w in seen))
        ours.append(len(calls))
    for i in range(batch):
        core.abort(f"s{i}")
    return {"batch": batch, "steps": steps, "driver_syncs_per_step": driver,
            "counted_reads_per_step": ours, "graphs": parts.runner.graphs is not None}


def roofline(path: Path, spec: ModelSpec, device: torch.device, dtype: str,
             batches: tuple[int, ...], ctx: int, steps: int,
             rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {"context": ctx, "batches": {}}
    tdtype = getattr(torch, dtype)
    machine = measure_machine(device, tdtype, quick=device.type != "cuda")
    out["machine"] = {"copy_gbps": machine.copy_gbps, "matmul_gflops": machine.matmul_gflops}
    for graphs in (True, False):
        parts = engine(path, str(device), dtype, graphs, max(batches))
        for b in batches:
            got = decode_step_rounds(parts, b, ctx, steps, (4, spec.vocab_size), rounds,
                                     lambda: machine)
            step = statistics.median(r.seconds for r in got)
            ideal = statistics.median(roofline_s(spec, tdtype, b, r.context, machine)
                                      for r in got)
            row = out["batches"].setdefault(str(b), {})
            key = "graphs" if graphs else "eager"
            row[f"step_ms_{key}"] = step * 1e3
            row["roofline_ms"] = ideal * 1e3
            row[f"over_roofline_{key}"] = step / ideal
        out["graphs_captured" if graphs else "eager_graphs"] = parts.runner.graphs is not None
        del parts
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for row in out["batches"].values():
        row["graphs_speedup"] = row["step_ms_eager"] / row["step_ms_graphs"]
    return out


def bench(out_dir: Path, device: str, timeout: float) -> dict[str, Any]:
    path = out_dir / "bench.json"
    cmd = [sys.executable, "-m", "backend.bench", "--device", device, "--dtype", "bfloat16",
           "--json", str(path)]
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:  # keep what it printed
        def text(b: bytes | str | None) -> str:
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        (out_dir / "bench.log").write_text(text(exc.stdout) + text(exc.stderr))
        raise
    (out_dir / "bench.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 and not path.is_file():
        raise RuntimeError(f"backend.bench exited {proc.returncode}: {proc.stderr[-2000:]}")
    figures = json.loads(path.read_text())
    return {"returncode": proc.returncode,
            **{k: v for k, v in figures.items() if k != "details"}}


def preflight(path: Path, device: torch.device, dtype: str) -> dict[str, Any]:
    """Seconds, not minutes: the model builds (the Triton kernel compiles, the graphs are
    captured) and a few steps run, before the long sections spend the device's time."""
    parts = engine(path, str(device), dtype, True, 8)
    core = parts.core
    core.add_request("pre", [5] * 40, bench_params(6))
    tokens = 0
    while core.has_work():
        tokens += sum(len(d.token_ids) for d in core.step())
    kernel = type(getattr(parts.runner.model, "decode_kernel", None)).__name__
    return {"tokens": tokens, "attention_kernel": kernel,
            "graphs": None if parts.runner.graphs is None else parts.runner.graphs.buckets,
            "batch_sampling": parts.core.batch_sampling}


def section(report: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]],
            out: Path) -> None:
    """Run one section; its figures or its error go into the report, written at once (a
    run cut short keeps what it measured)."""
    began = time.monotonic()
    try:
        report[name] = fn()
    except Exception as exc:  # noqa: BLE001 - a failed section is recorded; the rest run
        report[name] = {"error": repr(exc), "traceback": traceback.format_exc()[-4000:]}
    report[name]["seconds"] = round(time.monotonic() - began, 1)
    (out / JSON_NAME).write_text(json.dumps(report, indent=2, default=str))
    print(f"[gpu-check] {name}: {json.dumps(report[name], default=str)[:600]}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.bench.gpu_check",
                                 description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--out", type=Path, required=True, help="where gpu-check.json goes")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", choices=sorted(MODELS), default="0.5b")
    ap.add_argument("--no-bench", action="store_true", help="skip python -m backend.bench")
    ap.add_argument("--bench-timeout", type=float, default=240.0)
    ap.add_argument("--quick", action="store_true",
                    help="small batches and few steps (the CPU smoke test)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    spec = MODELS[args.model]
    report: dict[str, Any] = {"env": {
        "torch": torch.__version__, "device": args.device, "dtype": args.dtype,
        "model": args.model, "params": spec.num_params,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }}
    try:
        import triton
        report["env"]["triton"] = triton.__version__
    except ImportError:
        report["env"]["triton"] = None
    batches = (1, 2) if args.quick else BATCHES
    with tempfile.TemporaryDirectory() as tmp:
        small = write_checkpoint(Path(tmp) / "small", TEST_MODEL, getattr(torch, args.dtype))
        section(report, "preflight", lambda: preflight(small, device, args.dtype), args.out)
        if "error" in report["preflight"]:
            print("[gpu-check] the preflight failed: nothing else runs", flush=True)
            return 1
        path = write_checkpoint(Path(tmp) / "ckpt", spec, getattr(torch, args.dtype))
        section(report, "parity", lambda: parity(path, device, args.dtype, 4 if args.quick
                                                 else 8, 8 if args.quick else 32), args.out)
        section(report, "syncs", lambda: sync_counts(path, device, args.dtype, 6,
                                                     3 if args.quick else 8), args.out)
        section(report, "roofline", lambda: roofline(
            path, spec, device, args.dtype, batches, 32 if args.quick else 512,
            2 if args.quick else 16, 1 if args.quick else 3), args.out)
    if not args.no_bench:
        section(report, "bench", lambda: bench(args.out, args.device, args.bench_timeout),
                args.out)
    print(f"[gpu-check] wrote {args.out / JSON_NAME}")
    return 1 if any("error" in v for v in report.values() if isinstance(v, dict)) else 0


if __name__ == "__main__":
    sys.exit(main())
