"""What encoding one gateway request's trace costs, C against Python, in one run.

    python -m telemetry.bench.encoder_cost [--requests N]

Builds N requests' span trees in the shape the gateway records them, then times, per
request: recording the trace, ``to_record`` and ``marshal`` (the serving process's share),
and ``marshal.loads`` + encoding with each encoder (the shipper's share), best of five
passes. Both encoders must give the same bytes; the run fails otherwise.

The tree mirrors ``gateway/tracing.py``'s ``RequestTrace`` (telemetry imports no gateway
code, so ``GatewayShapedTrace`` below rebuilds it with the same calls on the OpenTelemetry
API and ``telemetry.record_phase``): a ``sluice.request`` SERVER root with ~28 attributes,
seven version strings among them, set once at the end; six phase spans batched as children
(the upstream one a CLIENT span with its own id for ``traceparent``); a
``gen_ai.first_token`` event. Token counts, timings and request ids vary per request. If
``RequestTrace`` changes shape, change this with it, or the figures stop describing the
gateway.
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

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from telemetry import extract, new_span_id, record_phase
from telemetry.otlp import Encoder, to_record
from telemetry.tracing import Sampler, TracerProvider

# the gateway's phase span names (gateway/tracing.py), children of sluice.request
AUTH = "sluice.auth"
RESERVE = "sluice.admission.reserve"
QUEUE = "sluice.queue.wait"
UPSTREAM = "sluice.upstream"
RELAY = "sluice.relay"
SETTLE = "sluice.settle"

STAMP = {"gen_ai.response.model": "tiny", "sluice.model.revision": "a" * 64,
         "sluice.tokenizer": "b" * 64, "sluice.chat_template": "c" * 64,
         "sluice.engine": "sluice-engine 0.1.0", "sluice.policy": "d" * 16,
         "sluice.system_fingerprint": "fp_" + "e" * 12}
# RequestTrace.set's short keywords -> attribute names (the ones this bench passes)
NAMES = {"tenant": "sluice.tenant.id", "priority": "sluice.priority",
         "model": "gen_ai.request.model", "max_tokens": "gen_ai.request.max_tokens",
         "temperature": "gen_ai.request.temperature", "stream": "sluice.stream",
         "input_tokens": "gen_ai.usage.input_tokens",
         "output_tokens": "gen_ai.usage.output_tokens",
         "cached_tokens": "gen_ai.usage.cached_tokens",
         "finish_reason": "gen_ai.response.finish_reasons", "queue_ms": "sluice.queue_ms",
         "worst_case": "sluice.reserved_tokens"}

Phase = tuple[str, int, "dict[str, Any] | None", int]  # name, start ns, attributes, span id
# (as in the gateway: looking a member up on the enum class runs Python code)
_CLIENT, _INTERNAL, _SERVER = SpanKind.CLIENT, SpanKind.INTERNAL, SpanKind.SERVER


class GatewayShapedTrace:
    """One request's trace, recorded with the calls ``gateway.tracing.RequestTrace`` makes
    (so that "recording" costs what it costs the gateway): root attributes collect in a
    dict set once at ``finish``; a phase is a tuple until it ends as a batched child."""

    __slots__ = ("attrs", "root", "tracer")

    def __init__(self, tracer: trace.Tracer, route: str, request_id: str) -> None:
        self.tracer = tracer
        self.root = tracer.start_span("sluice.request", extract(None, None), _SERVER)
        self.attrs: dict[str, Any] = {
            "http.request.method": "POST", "http.route": route, "sluice.request.id": request_id,
            "gen_ai.operation.name": "chat" if route.endswith("chat/completions")
            else "text_completion"}

    def start(self, name: str, attributes: dict[str, Any] | None = None) -> Phase:
        return (name, time.time_ns(), attributes, new_span_id() if name == UPSTREAM else 0)

    def end(self, phase: Phase, **attributes: Any) -> None:
        name, start_ns, attrs, span_id = phase
        if attributes:
            attrs = {**attrs, **attributes} if attrs else attributes
        record_phase(self.tracer, self.root, name, start_ns, time.time_ns(), attrs,
                     _CLIENT if span_id else _INTERNAL, span_id)

    def set(self, **attributes: Any) -> None:
        for key, value in attributes.items():
            if value is not None:
                self.attrs[NAMES.get(key, key)] = value

    def first_token(self, ttft_s: float) -> None:
        ms = round(ttft_s * 1000, 3)
        self.attrs["sluice.ttft_ms"] = ms
        self.root.add_event("gen_ai.first_token", {"sluice.ttft_ms": ms})

    def upstream_headers(self, phase: Phase) -> list[tuple[bytes, bytes]]:
        ctx = self.root.get_span_context()
        value = f"00-{ctx.trace_id:032x}-{phase[3]:016x}-{int(ctx.trace_flags):02x}"
        return [(b"traceparent", value.encode())]

    def finish(self, status: int, outcome: str) -> None:
        self.attrs["http.response.status_code"] = status
        self.attrs["sluice.outcome"] = outcome
        self.root.set_attributes(self.attrs)
        self.root.end()


def one_request(tracer: trace.Tracer, rng: random.Random, i: int) -> None:
    """The calls the gateway's relay makes for one streamed chat request."""
    rt = GatewayShapedTrace(tracer, "/v1/chat/completions", f"req-{i:08x}")
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
    parser = argparse.ArgumentParser(prog="python -m telemetry.bench.encoder_cost",
                                     description=(__doc__ or "").split("\n\n")[0])
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
    native = Encoder({}, native=True)
    if native.native:  # the C extension is built
        encoders.append(("c", native))
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
