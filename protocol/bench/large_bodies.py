"""What a large request body costs the server, parser against parser and in-loop against
the parse pool, in one run.

    python -m protocol.bench.large_bodies [--repeat N]

Three bodies: a 1 KB chat request, one message of 3.8 MB of text (``"word " × 760,000``),
and 120,000 empty messages (3.96 MB of JSON). For each, best of N (default 5):

- ``json``: the standard parser (``json.loads``), what ``json_body`` falls back to;
- ``orjson``: what ``json_body.loads_strict`` parses with first;
- ``loads_strict``: the whole strict parse (depth scan, orjson, the checks);
- ``pool/pipe`` and ``pool/file``: a warm ``large_bodies.parse_pool`` round trip, the body and
  its object sent through the executor's pipe (``parse_job``) or through a file in memory
  (``parse_body``, what the gateway does), with the longest stall of the event loop meanwhile
  (a ticker that sleeps 1 ms at a time).

Nothing is asserted; the figures are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from protocol.errors import BadRequest
from protocol.json_body import loads_strict
from protocol.large_bodies import parse_body, parse_job, parse_pool
from protocol.offload import WorkPool


def bodies() -> dict[str, bytes]:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hello " * 150}]}
    one = {"model": "m", "messages": [{"role": "user", "content": "word " * 760_000}]}
    many = {"model": "m", "messages": [{"role": "user", "content": ""}] * 120_000}
    return {name: json.dumps(b).encode()
            for name, b in (("1 KB chat", chat), ("one 3.8 MB message", one),
                            ("120k empty messages", many))}


def best_ms(fn: Callable[[], Any], repeat: int, inner: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best * 1000


def refused_too(fn: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def run(raw: bytes) -> Any:
        try:
            return fn(raw)
        except BadRequest as err:  # 120k messages: refused, which is the point
            return err
    return run


async def pooled(pool: WorkPool, call: Callable[[], Awaitable[Any]],
                 repeat: int) -> tuple[float, float]:
    """Best round trip (ms) and the longest loop stall (ms) over the runs."""
    best, stall = float("inf"), 0.0
    for _ in range(repeat):
        done = asyncio.Event()
        ticker = asyncio.ensure_future(_tick(done))
        t0 = time.perf_counter()
        try:
            await call()
        except BadRequest:
            pass
        best = min(best, time.perf_counter() - t0)
        done.set()
        stall = max(stall, await ticker)
    return best * 1000, stall * 1000


async def _tick(done: asyncio.Event) -> float:
    """The longest gap between 1 ms sleeps of the event loop until ``done``."""
    worst, last = 0.0, time.perf_counter()
    while not done.is_set():
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
    return worst


async def pool_figures(repeat: int) -> dict[str, tuple[float, float, float, float]]:
    pool = parse_pool()
    pool.warm()
    await asyncio.sleep(2.0)  # the workers start and import
    out = {}
    try:
        for name, raw in bodies().items():
            pipe = await pooled(pool, functools.partial(pool.run, "t", parse_job(raw)), repeat)
            file = await pooled(pool, functools.partial(parse_body, pool, "t", raw), repeat)
            out[name] = (*pipe, *file)
    finally:
        pool.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m protocol.bench.large_bodies",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    print(f"{'body':<22} {'json ms':>9} {'orjson ms':>10} {'ratio':>6} {'strict ms':>10}")
    for name, raw in bodies().items():
        inner = 2000 if len(raw) < 10_000 else 1
        a = best_ms(functools.partial(json.loads, raw), args.repeat, inner)
        b = best_ms(functools.partial(orjson.loads, raw), args.repeat, inner)
        c = best_ms(functools.partial(refused_too(loads_strict), raw), args.repeat, inner)
        print(f"{name:<22} {a:>9.4f} {b:>10.4f} {a / b:>6.2f} {c:>10.4f}")
    print(f"\n{'body':<22} {'pipe ms':>8} {'loop stall':>10} {'file ms':>8} {'loop stall':>10}")
    for name, (pipe, pstall, file, fstall) in asyncio.run(pool_figures(args.repeat)).items():
        print(f"{name:<22} {pipe:>8.1f} {pstall:>10.1f} {file:>8.1f} {fstall:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
