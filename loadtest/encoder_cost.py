"""What encoding one gateway request's trace costs, C against Python, in one run.

    python -m loadtest.encoder_cost [--requests N]

Builds N requests' span trees the way the gateway does (``gateway.tracing.RequestTrace``:
a root with ~28 attributes, seven version strings among them, six phases and a
first-token event; token counts, timings and request ids vary per request), then times,
per request: recording the trace, ``to_record`` and ``marshal`` (the serving process's
share), and ``marshal.loads`` + encoding with each encoder (the shipper's share), best of
five passes. Both encoders must give the same bytes; the run fails otherwise.
"""

from __future__ import annotations

import argparse
import gc
import marshal
import random
import sys
import time
from collections.abc import Callable
from typing import Any

from gateway.tracing import AUTH, QUEUE, RELAY, RESERVE, SETTLE, UPSTREAM, RequestTrace
from telemetry import otlp
from telemetry.otlp import Encoder, to_record
from telemetry.tracing import Sampler, TracerProvider

STAMP = {"gen_ai.response.model": "tiny", "sluice.model.revision": "a" * 64,
         "sluice.tokenizer": "b" * 64, "sluice.chat_template": "c" * 64,
         "sluice.engine": "sluice-engine 0.1.0", "sluice.policy": "d" * 16,
         "sluice.system_fingerprint": "fp_" + "e" * 12}


def one_request(tracer: Any, rng: random.Random, i: int) -> None:
    """The calls the gateway's relay makes for one streamed chat request."""
    rt = RequestTrace(tracer, "/v1/chat/completions", f"req-{i:08x}", None, None)
    span = rt.start(AUTH)
    rt.end(span, **{"sluice.tenant.id": "acme"})
    rt.set(tenant="acme")
    rt.set(priority=1, model="tiny", max_tokens=rng.choice((64, 128, 256)), temperature=0.7,
           stream=True, worst_case=rng.randrange(100, 900))
    rt.attrs.update(STAMP)
    span = rt.start(RESERVE, {"sluice.reserved_tokens": 300})
    rt.end(span, **{"sluice.granted": True, "sluice.fail_open": False})
    span = rt.start(QUEUE, {"sluice.queue.length": rng.randrange(4)})
    queue_ms = round(rng.random(), 3)
    rt.end(span, **{"sluice.queue_ms": queue_ms})
    rt.set(queue_ms=queue_ms)
    up = rt.start(UPSTREAM, {"server.address": "tiny", "url.path": "/v1/chat/completions",
                             "sluice.upstream.member": "http://127.0.0.1:8001",
                             "sluice.attempt": 1, "sluice.breaker.state": "closed",
                             "sluice.breaker.probe": False})
    rt.upstream_headers(up)
    rt.first_token(rng.random() / 10)
    relay = rt.start(RELAY)
    rt.end(relay, **{"sluice.chunks": rng.randrange(1, 200)})
    rt.end(up, **{"http.response.status_code": 200})
    settle = rt.start(SETTLE)
    tokens_in, tokens_out = rng.randrange(10, 2000), rng.randrange(1, 256)
    rt.end(settle, **{"gen_ai.usage.input_tokens": tokens_in,
                      "gen_ai.usage.output_tokens": tokens_out})
    rt.set(input_tokens=tokens_in, output_tokens=tokens_out, cached_tokens=0,
           finish_reason=("length",))
    rt.finish(200, "success")


def each(fn: Callable[[Any], Any], items: list[Any]) -> Callable[[], None]:
    """A pass calling ``fn`` on every item, keeping no result (as the shipper does)."""
    def run() -> None:
        for item in items:
            fn(item)
    return run


def best_us(fn: Callable[[], None], n: int, passes: int = 5) -> float:
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.encoder_cost",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    args = parser.parse_args(argv)
    n = args.requests
    spans: list[Any] = []
    tracer = TracerProvider(Sampler("always_on"), spans.append, seed=1).get_tracer(
        "sluice.gateway", "0.1.0")

    def record_all() -> None:
        spans.clear()
        rng = random.Random(7)
        for i in range(n):
            one_request(tracer, rng, i)

    recording = best_us(record_all, n)
    records = [to_record(s) for s in spans]
    frames = [marshal.dumps(r, 2) for r in records]
    # the inputs live through the run: out of the collector's way, as the gateway's
    # start-up state is (gc.freeze), so that the timings are the calls' own
    gc.collect()
    gc.freeze()
    to_rec = best_us(each(to_record, spans), n)
    dumps = best_us(each(lambda r: marshal.dumps(r, 2), records), n)
    loads = best_us(each(marshal.loads, frames), n)
    rows = [("recording (RequestTrace calls, serving process)", recording),
            ("to_record (serving process)", to_rec),
            ("marshal.dumps (serving process)", dumps),
            ("marshal.loads (shipper)", loads)]
    python = Encoder({}, native=False)
    out: dict[str, float] = {}
    encoders = [("python", python)]
    if otlp._native is not None:
        encoders.append(("c", Encoder({}, native=True)))
    for name, enc in encoders:
        out[name] = best_us(each(enc.record, records), n)
        rows.append((f"encode, {name} (shipper)", out[name]))
    if "c" in out:
        same = all(encoders[1][1].record(r) == python.record(r) for r in records)
        if not same:
            print("the C and Python encoders disagree", file=sys.stderr)
            return 1
    print(f"per request, {n} requests, {len(records[0][16]) + 1} spans and "
          f"{len(records[0][11])} root attributes each, best of 5 passes:")
    for label, us in rows:
        print(f"  {label:<50}{us:8.2f} µs")
    if "c" in out:
        print(f"  python / c encoding: {out['python'] / out['c']:.1f}x (same bytes: yes)")
    else:
        print("  the C encoder is not built (telemetry/_otlp.c; a C compiler at install time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
