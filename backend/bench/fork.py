"""``n`` > 1 by forking, side by side with ``n`` = 1: ``python -m backend.bench.fork``.

The engine (tiny model unless ``--model``) serves a ``--prompt``-token prompt (1,000 by
default) with ``n`` = 1 and with ``n`` = ``--n`` (4), alternating for ``--rounds`` rounds,
each round on fresh prompt tokens so that the prefix cache never helps either side. It
reports:

* **TTFT**: the median of each side, and the median over rounds of each round's ratio
  ``n / n=1`` (target <= 1.3: the prompt is prefilled once, and the first token of every
  choice is sampled from that one prefill's logits);
* **prompt tokens computed** by the model for each side (``n`` x prompt without forking);
* **KV blocks held mid-generation**, from the engine's state snapshot (what ``/v1/state``
  serves: ``kv_blocks_total - kv_blocks_free``) once every choice has made ``--tokens``
  tokens, against the prompt's full blocks + ``n`` x each choice's own blocks (the
  prompt's last, partial block is copied per choice) and against ``n`` x (prompt + output)
  blocks, which ``n`` independent requests would hold.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

from backend.engine.builder import EngineParts, build_engine
from backend.engine.config import EngineConfig
from backend.engine.engine import LLMEngine
from backend.engine.sampling import SamplingParams
from backend.engine.scheduler import ScheduledChunk

TTFT_TARGET = 1.3


def count_prompt_tokens(core: LLMEngine) -> list[int]:
    """Wrap the runner: the box holds how many prompt positions the model has computed."""
    box = [0]
    execute = core.runner.execute

    def counting(chunks: list[ScheduledChunk]) -> Any:
        for c in chunks:
            box[0] += max(0, min(c.start + c.num_new_tokens, c.seq.num_prompt_tokens) - c.start)
        return execute(chunks)

    core.runner.execute = counting  # type: ignore[method-assign]
    return box


def one_run(core: LLMEngine, rid: str, prompt: list[int], n: int,
            tokens: int) -> tuple[float, int | None]:
    """Serve one request to the end; its TTFT (s) and the KV blocks held once every choice
    had made ``tokens`` tokens."""
    core.add_request(rid, prompt, SamplingParams(max_tokens=tokens + 4, temperature=0.8,
                                                 seed=1, ignore_eos=True, n=n))
    made = [0] * n
    held = None
    while core.has_work():
        for d in core.step():
            made[d.index] += len(d.token_ids)
            if d.finished:
                assert d.metrics is not None and d.metrics.ttft is not None
                ttft = d.metrics.ttft
        if held is None and min(made) >= tokens:
            st = core.state()  # the snapshot /v1/state serves
            held = st.kv_blocks_total - st.kv_blocks_free
    return ttft, held


def run(parts: EngineParts, prompt_len: int, n: int, tokens: int, rounds: int,
        seed: int) -> dict[str, Any]:
    core = parts.core
    computed = count_prompt_tokens(core)
    rng = random.Random(seed)
    vocab = parts.model_config.vocab_size

    def prompt() -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(prompt_len)]

    one_run(core, "warm-1", prompt(), 1, 2)  # kernels compiled, caches warm
    one_run(core, "warm-n", prompt(), n, 2)
    ttft: dict[int, list[float]] = {1: [], n: []}
    prefill: dict[int, int] = {}
    held: dict[int, int | None] = {}
    ratios = []
    for r in range(rounds):
        order = (1, n) if r % 2 == 0 else (n, 1)  # alternate who goes first
        for k in order:
            before = computed[0]
            t, h = one_run(core, f"r{r}-n{k}", prompt(), k, tokens)
            ttft[k].append(t)
            prefill[k], held[k] = computed[0] - before, h
        ratios.append(ttft[n][-1] / ttft[1][-1])
    bs = core.block_manager.block_size
    full, tail = divmod(prompt_len, bs)
    kv_tokens = tokens - 1  # the KV of the last token made is not computed yet
    own = -(-(tail + kv_tokens) // bs)
    return {
        "prompt_tokens": prompt_len, "n": n, "rounds": rounds, "block_size": bs,
        "ttft_s": {str(k): statistics.median(v) for k, v in ttft.items()},
        "ttft_ratio": statistics.median(ratios),
        "prompt_tokens_computed": {str(k): v for k, v in prefill.items()},
        "kv_blocks_held": {str(k): v for k, v in held.items()},
        "kv_blocks_expected": full + n * own,
        "kv_blocks_prompt": -(-prompt_len // bs),
        "kv_blocks_unshared": n * -(-(prompt_len + kv_tokens) // bs),
        "tokens_per_choice": tokens,
    }


def format_report(r: dict[str, Any]) -> str:
    n = r["n"]
    t1, tn = r["ttft_s"]["1"] * 1e3, r["ttft_s"][str(n)] * 1e3
    ok_ttft = r["ttft_ratio"] <= TTFT_TARGET
    p1, pn = r["prompt_tokens_computed"]["1"], r["prompt_tokens_computed"][str(n)]
    held = r["kv_blocks_held"][str(n)]
    ok_kv = held == r["kv_blocks_expected"]
    lines = [f"{r['prompt_tokens']}-token prompt, n={n}, {r['rounds']} rounds (medians)"]
    lines.append(f"TTFT              n=1 {t1:7.1f} ms   n={n} {tn:7.1f} ms   "
                 f"ratio {r['ttft_ratio']:.2f}  (target <= {TTFT_TARGET}: "
                 f"{'PASS' if ok_ttft else 'FAIL'})")
    lines.append(f"prompt computed   n=1 {p1:7d} tok   n={n} {pn:7d} tok   ratio "
                 f"{pn / p1:.2f}  ({'PASS: prefilled once' if pn == p1 else 'FAIL'})")
    lines.append(f"KV blocks held    n=1 {r['kv_blocks_held']['1']:7d}       n={n} "
                 f"{held:7d}       after {r['tokens_per_choice']} tokens per choice")
    lines.append(f"  prompt's blocks {r['kv_blocks_prompt']} (full "
                 f"{r['prompt_tokens'] // r['block_size']}) + {n} x own = "
                 f"{r['kv_blocks_expected']} expected; {n} x (prompt + output) = "
                 f"{r['kv_blocks_unshared']}  ({'PASS' if ok_kv else 'FAIL'}: held / "
                 f"unshared {held / r['kv_blocks_unshared']:.2f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.bench.fork", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="checkpoint directory (default: tiny)")
    ap.add_argument("--prompt", type=int, default=1000, help="prompt tokens (default 1000)")
    ap.add_argument("--n", type=int, default=4, help="choices (default 4)")
    ap.add_argument("--tokens", type=int, default=40,
                    help="tokens per choice when the KV blocks are read (default 40)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.n < 2 or args.rounds < 1 or args.tokens < 1 or args.prompt < 1:
        ap.error("--n must be >= 2, --rounds, --tokens and --prompt >= 1")
    parts = build_engine(EngineConfig(model=args.model, device="cpu",
                                      num_threads=args.threads))
    if args.prompt + args.tokens + 4 > parts.core.max_model_len:
        ap.error(f"--prompt + --tokens must fit the context ({parts.core.max_model_len})")
    result = run(parts, args.prompt, args.n, args.tokens, args.rounds, args.seed)
    print(format_report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
