"""`sluice loadtest`'s one-off flags: `--rate 8` instead of a YAML edit, or no YAML at all.

The flags edit the workload document before it is validated, so a bad value fails exactly
as it would in the file (exit status 2, the message naming the field). Without a workload
file the flags describe the whole run: one class, fixed lengths, no SLOs.
"""

from __future__ import annotations

import argparse
import copy
import math
from pathlib import Path
from typing import Any

from loadtest.workload import Workload, WorkloadError, parse_workload, read_workload_data

DEFAULT_PROMPT_TOKENS = 128
DEFAULT_MAX_TOKENS = 128
DEFAULT_DURATION_S = 60.0
CLOSED_CAP_S = 3600.0  # closed loop with only --requests: the run ends at the cap first


def add_override_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("one-off overrides (the workload file's values, or the whole "
                             "run without one)")
    g.add_argument("--rate", type=float, metavar="R",
                   help="open loop: mean requests/s (scales the file's arrival process; "
                        "Poisson without a file)")
    g.add_argument("--arrival", choices=("poisson", "constant"),
                   help="with --rate: the arrival process (replaces the file's)")
    g.add_argument("--concurrency", type=int, metavar="N",
                   help="closed loop: keep N requests in flight")
    g.add_argument("--think-time-ms", type=float, metavar="MS",
                   help="closed loop: pause between a slot's requests")
    g.add_argument("--duration", type=float, metavar="S", help="seconds of load")
    g.add_argument("--requests", type=int, metavar="N", help="stop after N requests")
    g.add_argument("--warmup", type=float, metavar="S", help="seconds not measured at the start")
    g.add_argument("--cooldown", type=float, metavar="S", help="seconds not measured at the end")
    g.add_argument("--model", help="model name sent (default without a file: the target's "
                                   "first /v1/models entry)")
    g.add_argument("--api", choices=("chat", "completions"), help="endpoint (default chat)")
    g.add_argument("--max-tokens", type=int, metavar="N",
                   help=f"output tokens of every request (default without a file "
                        f"{DEFAULT_MAX_TOKENS})")
    g.add_argument("--prompt-tokens", type=int, metavar="N",
                   help=f"input tokens of every request (default without a file "
                        f"{DEFAULT_PROMPT_TOKENS})")
    g.add_argument("--seed", type=int, help="the schedule's seed")
    d = p.add_argument_group("real data (docs/loadtest.md: Real data)")
    d.add_argument("--dataset", metavar="FILE",
                   help="prompts from FILE: JSONL of prompt/messages, or ShareGPT JSON")
    d.add_argument("--tokenizer", metavar="DIR",
                   help="count dataset prompts with DIR/tokenizer.json (default: the "
                        "target's /v1/tokenize)")
    d.add_argument("--dataset-order", choices=("random", "sequential"),
                   help="entry order (default random, by the seed)")
    d.add_argument("--dataset-sample", type=int, metavar="N", help="use N entries at most")
    d.add_argument("--dataset-min-input", type=int, metavar="N",
                   help="drop entries with fewer prompt tokens")
    d.add_argument("--dataset-max-input", type=int, metavar="N",
                   help="drop entries with more prompt tokens")
    d.add_argument("--dataset-max-output", type=int, metavar="N",
                   help="drop entries whose reference answer has more tokens")


def _lengths(cls: dict[str, Any], field: str, value: int) -> None:
    """Set ``field`` (input/output) of every length bucket or pair of a class to ``value``."""
    lengths = cls.get("lengths")
    if not isinstance(lengths, dict):
        return
    if isinstance(lengths.get("buckets"), list):
        for b in lengths["buckets"]:
            if isinstance(b, dict):
                b[field] = value
    if isinstance(lengths.get("pairs"), list):
        at = 0 if field == "input" else 1
        lengths["pairs"] = [[value if j == at else x for j, x in enumerate(pair)]
                            if isinstance(pair, list) else pair for pair in lengths["pairs"]]


def _bare(args: argparse.Namespace) -> dict[str, Any]:
    """The whole workload from flags: one class, fixed lengths, no SLO."""
    sweep = getattr(args, "sweep_concurrency", None)
    if args.rate is None and args.concurrency is None and not sweep:
        raise WorkloadError("without a workload file, give --rate R (open loop) or "
                            "--concurrency N (closed loop)")
    data: dict[str, Any] = {
        "name": "cli", "seed": 0, "duration_s": DEFAULT_DURATION_S,
        "classes": [{"name": "default", "share": 1, "lengths": {"buckets": [{
            "input": args.prompt_tokens or DEFAULT_PROMPT_TOKENS,
            "output": args.max_tokens or DEFAULT_MAX_TOKENS}]}}]}
    if args.rate is None and args.concurrency is None and sweep:
        data["concurrency"] = sweep[0]  # each run of the sweep sets its own
    if args.requests is not None and args.duration is None:
        # the requests end the run: open loop draws enough arrivals, closed loop a cap
        data["duration_s"] = (CLOSED_CAP_S if args.rate is None
                              else args.requests / args.rate * 4 + 10)
    return data


_DATASET_FLAGS = (("dataset_order", "order"), ("dataset_sample", "sample"),
                  ("dataset_min_input", "min_input_tokens"),
                  ("dataset_max_input", "max_input_tokens"),
                  ("dataset_max_output", "max_output_tokens"))


def _dataset(args: argparse.Namespace, data: dict[str, Any]) -> None:
    """``--dataset FILE`` replaces the file's ``dataset:``; the other dataset flags edit
    whichever dataset the run has (and need one)."""
    spec: Any = data.get("dataset")
    if args.dataset is not None:
        spec = {"path": str(Path(args.dataset).resolve())}
    given = [(key, getattr(args, flag)) for flag, key in _DATASET_FLAGS
             if getattr(args, flag) is not None]
    if args.tokenizer is not None:
        given.append(("tokenizer", str(Path(args.tokenizer).resolve())))
    if not given and args.dataset is None:
        return
    if not isinstance(spec, dict):
        raise WorkloadError("--tokenizer and --dataset-* apply to a dataset: give "
                            "--dataset FILE (or dataset: in the workload file)")
    spec = dict(spec)
    spec.update(given)
    data["dataset"] = spec


def apply_overrides(data: object, args: argparse.Namespace) -> dict[str, Any]:
    """The workload document with the flags applied (a copy)."""
    if not isinstance(data, dict):
        raise WorkloadError("workload: the file must hold a mapping")
    if args.rate is not None and not (math.isfinite(args.rate) and args.rate > 0):
        raise WorkloadError(f"arrival.rate: --rate must be a positive number, not {args.rate}")
    out: dict[str, Any] = copy.deepcopy(data)
    for flag, key in (("seed", "seed"), ("duration", "duration_s"), ("warmup", "warmup_s"),
                      ("cooldown", "cooldown_s"), ("requests", "requests"), ("api", "api"),
                      ("think_time_ms", "think_time_ms")):
        if getattr(args, flag) is not None:
            out[key] = getattr(args, flag)
    if args.model is not None:
        out["model"] = args.model
    for cls in out.get("classes") or []:
        if not isinstance(cls, dict):
            continue
        if args.model is not None:
            cls.pop("model", None)
        if args.prompt_tokens is not None:
            _lengths(cls, "input", args.prompt_tokens)
        if args.max_tokens is not None:
            _lengths(cls, "output", args.max_tokens)
    if args.concurrency is not None:
        if args.rate is not None:
            raise WorkloadError("--rate (open loop) and --concurrency (closed loop) exclude "
                                "each other")
        out.pop("arrival", None)
        out["concurrency"] = args.concurrency
    elif args.rate is not None:
        arrival = out.get("arrival")
        if args.arrival is not None or not isinstance(arrival, dict):
            out["arrival"] = {"process": args.arrival or "poisson", "rate": args.rate}
        out.pop("concurrency", None)
        out.pop("think_time_ms", None)
    elif args.arrival is not None:
        raise WorkloadError("--arrival goes with --rate")
    _dataset(args, out)
    return out


def build_workload(args: argparse.Namespace) -> tuple[Workload, Path]:
    """The run's workload (file + flags, or flags alone) and the directory its relative
    paths resolve from."""
    if args.workload is not None:
        path = Path(args.workload)
        data, base = read_workload_data(path), path.parent
    else:
        data, base = _bare(args), Path.cwd()
    w = parse_workload(apply_overrides(data, args), base)
    if args.rate is not None and args.arrival is None and w.arrival is not None \
            and args.workload is not None and w.mean_rate() != args.rate:
        w = w.scaled(args.rate / w.mean_rate())  # keeps the file's process and shape
    return w, base
