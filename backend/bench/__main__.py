"""``python -m backend.bench [--quick] [--json FILE] [--device cpu|cuda] [--dtype D] [--http]``."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from .report import render
from .runner import run_bench
from .settings import FULL, QUICK

DTYPES = ("bfloat16", "float16", "float32")


def _finite(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _http_figures(quick: bool) -> dict[str, float]:
    if importlib.util.find_spec("backend.bench.http") is None:
        raise SystemExit("--http: backend/bench/http.py is not there yet")
    module = importlib.import_module("backend.bench.http")
    return dict(asyncio.run(module.run_http_bench(quick)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.bench", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller model and workload (<60 s)")
    ap.add_argument("--json", type=Path, metavar="FILE", help="write the figures here")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                    help="model and KV dtype (default bfloat16, as the issue asks)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads (default: torch's choice, one per core)")
    ap.add_argument("--load", type=float, default=None,
                    help="offered Poisson rate as a multiple of the continuous engine's "
                         "measured burst completion rate (default 1.0)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--http", action="store_true",
                    help="also run the HTTP bench (backend/bench/http.py)")
    args = ap.parse_args(argv)
    settings = QUICK if args.quick else FULL
    if args.load is not None:
        if args.load <= 0:
            ap.error("--load must be > 0")
        settings = replace(settings, load=args.load)
    if args.no_hf:
        settings = replace(settings, run_hf=False)
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)

    def progress(msg: str) -> None:
        print(f"[bench] {msg}", file=sys.stderr, flush=True)

    result = run_bench(settings, device=args.device, dtype=args.dtype, progress=progress)
    extra = _http_figures(args.quick) if args.http else {}
    print(render(result, extra))
    if args.json is not None:
        payload = {**result.as_json(), **extra}
        args.json.write_text(json.dumps(_finite(payload), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
