"""The fused decode steps' matmuls, side by side: ``python -m backend.bench.matmul``.

For each row count, one decode step's matmuls of the bench model (every layer's qkv, o,
gate_up and down, and the LM head; random weights in the bench dtype) are timed three
ways in the same run:

* ``c``: ``FusedDecoder.linear`` as the fused steps use it: the dot kernel under 10 rows,
  the 6 x 16 micro-kernel from 10 rows on;
* ``c_row``: the same C with the micro-kernel off (the dot kernel at every row count);
* ``onednn``: the oneDNN-prepacked float32 copy (``PackedLinear``), which steps of more
  than ``MAX_ROWS`` sequences and prefill use.

Each round times every side once, in a rotating order; a ratio is the median over rounds
of that round's ratio (this VM's speed drifts within minutes), a time the median over
rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from backend.engine.decode_kernel import load_decode_kernel
from backend.engine.fused_decode import MAX_ROWS
from backend.engine.loader import load_model
from backend.engine.weights import DecoderWeights, Matrix, PackedMatmul

from .checkpoint import FULL_MODEL, QUICK_MODEL, TEST_MODEL, ModelSpec, write_checkpoint

MODELS = {"full": FULL_MODEL, "quick": QUICK_MODEL, "test": TEST_MODEL}
SIDES = ("c", "c_row", "onednn")
DEFAULT_ROWS = (1, 8, 16, 32, 48, MAX_ROWS)


Matmul = tuple[torch.Tensor, torch.Tensor | None, PackedMatmul]


def _matmuls(weights: DecoderWeights) -> list[Matmul]:
    """(weight, bias, oneDNN copy) of one decode step's matmuls, in step order."""
    out: list[Matmul] = []
    for layer in weights.layers:
        packed = layer.packed
        if packed is None:
            raise RuntimeError("the model's matmuls are not prepacked")
        out += [(_dense(layer.qkv), layer.qkv_bias, packed.qkv),
                (_dense(layer.o), layer.o_bias, packed.o),
                (_dense(layer.gate_up), None, packed.gate_up),
                (_dense(layer.down), None, packed.down)]
    if weights.lm_head_packed is None:
        raise RuntimeError("the model's LM head is not prepacked")
    out.append((_dense(weights.lm_head), None, weights.lm_head_packed))
    return out


def _dense(matrix: Matrix) -> torch.Tensor:
    if not isinstance(matrix, torch.Tensor):  # quantized: backend.bench.quant times those
        raise TypeError("the matmul bench times unquantized models")
    return matrix


def run(spec: ModelSpec, dtype: torch.dtype, rows: list[int], rounds: int,
        progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    kernel = load_decode_kernel()
    if kernel is None:
        raise RuntimeError("the C kernels did not build (no C compiler?): nothing to compare")
    with tempfile.TemporaryDirectory(prefix="sluice-matmul-") as tmp:
        path = write_checkpoint(Path(tmp) / "model", spec, dtype)
        model: Any = load_model(path, dtype, torch.device("cpu")).model  # copied out of the file
    model.prepack_cpu_matmuls()
    model.set_decode_kernel(kernel)
    fused = model.fused
    if fused is None:
        raise RuntimeError("the fused decode steps do not apply to this model or CPU "
                           "(they need bf16 or fp32 weights and AVX2 + FMA)")
    mats = _matmuls(fused.weights)
    flops_per_row = 2 * sum(w.shape[0] * w.shape[1] for w, _, _ in mats)
    gen = torch.Generator().manual_seed(0)
    result: dict[str, Any] = {"rows": {}, "c_row_over_c": {}, "onednn_over_c": {}}
    for n in rows:
        xs = {k: torch.randn(n, k, generator=gen) for k in {w.shape[1] for w, _, _ in mats}}

        def step(side: str, xs: dict[int, torch.Tensor] = xs) -> None:
            for w, b, packed in mats:
                x = xs[w.shape[1]]
                if side == "onednn":
                    packed(x)
                else:
                    fused.linear(x, w, b, wide=side == "c")

        for side in SIDES:  # warm: first touches, scratch, oneDNN's primitive cache
            step(side)
        times: dict[str, list[float]] = {side: [] for side in SIDES}
        for r in range(rounds):
            for side in SIDES[r % 3:] + SIDES[:r % 3]:
                t0 = time.perf_counter()
                step(side)
                times[side].append(time.perf_counter() - t0)
        ms = {side: statistics.median(t) * 1e3 for side, t in times.items()}
        result["rows"][str(n)] = {
            **{f"{side}_ms": ms[side] for side in SIDES},
            **{f"{side}_gflops": flops_per_row * n / ms[side] / 1e6 for side in SIDES}}
        for side in ("c_row", "onednn"):
            result[f"{side}_over_c"][str(n)] = statistics.median(
                a / b for a, b in zip(times[side], times["c"], strict=True))
        progress(f"{n} rows: c {ms['c']:.2f} ms, c_row {ms['c_row']:.2f} ms, "
                 f"onednn {ms['onednn']:.2f} ms")
    result["details"] = {"dtype": str(model.dtype).removeprefix("torch."), "rounds": rounds,
                         "threads": torch.get_num_threads(), "matmuls": len(mats),
                         "flops_per_row": flops_per_row}
    return result


def format_table(result: dict[str, Any]) -> str:
    lines = [(f"{'rows':>4}  {'c ms (GFLOP/s)':>16}  {'c_row ms':>16}  {'onednn ms':>16}  "
              f"{'c_row/c':>7}  {'onednn/c':>8}")]
    for n, r in result["rows"].items():
        cells = [f"{r[f'{s}_ms']:7.2f} ({r[f'{s}_gflops']:4.0f})" for s in SIDES]
        lines.append(f"{n:>4}  {cells[0]:>16}  {cells[1]:>16}  {cells[2]:>16}  "
                     f"{result['c_row_over_c'][n]:7.2f}  {result['onednn_over_c'][n]:8.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.bench.matmul", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="full",
                    help="bench model sizes (default full: the ~56M model)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--rows", default=",".join(map(str, DEFAULT_ROWS)),
                    help=f"comma-separated row counts, each 1..{MAX_ROWS}")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    try:
        rows = [int(v) for v in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows: comma-separated integers, got {args.rows!r}")
    if not rows or any(not 1 <= n <= MAX_ROWS for n in rows):
        ap.error(f"--rows: each between 1 and {MAX_ROWS}, got {args.rows!r}")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    try:
        result = run(MODELS[args.model], getattr(torch, args.dtype), rows, args.rounds,
                     lambda m: print(f"[matmul] {m}", file=sys.stderr, flush=True))
    except (RuntimeError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(format_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
