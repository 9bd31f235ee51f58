"""Decode step time alone, for A/B runs of two checkouts side by side:
``python -m backend.bench.decode_step [--batches 1,32] [--context 128] [--steps 40]
[--rounds 5]`` prints ``{batch: median step ms}`` as JSON (the quick bench's 7M-parameter
model in bf16, on the CPU; ``roofline.decode_step_rounds``, more steps than the bench's)."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from backend.engine.builder import build_engine
from backend.engine.config import EngineConfig

from .checkpoint import QUICK_MODEL, write_checkpoint
from .roofline import decode_step_rounds, measure_machine


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp) / "m", QUICK_MODEL, torch.bfloat16)
        parts = build_engine(EngineConfig(model=str(path), device="cpu", dtype="bfloat16",
                                          max_num_seqs=64, kv_memory_gib=0.5))
        machine = measure_machine(torch.device("cpu"), torch.bfloat16, True)
        out = {}
        for b in (int(x) for x in args.batches.split(",")):
            rounds = decode_step_rounds(parts, b, args.context, args.steps,
                                        (4, QUICK_MODEL.vocab_size), args.rounds,
                                        lambda: machine)
            out[b] = round(statistics.median(r.seconds for r in rounds) * 1e3, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
