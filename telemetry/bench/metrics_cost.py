"""What recording one gateway request's metrics costs, prometheus_client against the
OpenTelemetry SDK, side by side in one run; and what one scrape / collect costs.

    python -m telemetry.bench.metrics_cost [--requests N] [--tenants T]

Per request, each side makes the calls ``gateway/observe.py`` makes for a successful streamed
chat request, on instruments with ``gateway/metrics.py``'s names, labels and buckets
(telemetry imports no gateway code, so ``PromGateway`` rebuilds them on a
``telemetry.metrics.Registry``): 4 counter increments (responses, requests, input and output
tokens), 9 histogram observations (queue time, TTFT, TPOT, E2E, and the GenAI request
duration, TTFT, TPOT and two token usages) and 20 inter-token gaps on the request's kept ITL
series. ``SdkGateway`` records the same values on the SDK's ``MeterProvider`` (counters and
histograms with the same bucket boundaries, attributes as dicts, the GenAI ones with their
OTel names), read by an ``InMemoryMetricReader``. Requests spread over T tenants. Figures
are the best of five passes, the sides interleaved. If ``observe`` changes what it records,
change this with it, or the figures stop describing the gateway.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from telemetry.genai import (
    DURATION_BUCKETS,
    PROVIDER,
    TOKEN_USAGE_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    GenAiClient,
    GenAiServer,
)
from telemetry.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS, Registry

P = "sluice_gateway_"
SLO = ("tenant", "model", "priority_class")
ROUTE, MODEL, OPERATION = "/v1/chat/completions", "tiny", "chat"
GAPS = 20  # inter-token gaps per request


@dataclass(slots=True, frozen=True)
class Req:
    """One request's values, drawn before timing."""

    tenant: str
    priority_class: str
    queue_s: float
    ttft_s: float
    tpot_s: float
    e2e_s: float
    prompt: int
    completion: int
    gaps: tuple[float, ...]


def requests(n: int, tenants: int, seed: int = 7) -> list[Req]:
    rng = random.Random(seed)
    return [Req(f"tenant-{i % tenants}", rng.choice(("p0", "p1-3", "p4-6")),
                rng.random() / 100, rng.random() / 5, rng.random() / 20, rng.random() * 5,
                rng.randrange(10, 4000), rng.randrange(2, 512),
                tuple(rng.random() / 20 for _ in range(GAPS)))
            for i in range(n)]


class PromGateway:
    """The gateway's per-request instruments on ``telemetry.metrics.Registry``."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.responses = r.counter(P + "responses_total", "Responses.", ("route", "tenant",
                                                                         "status"))
        self.requests = r.counter(P + "requests_total", "Requests.", ("tenant", "model",
                                                                      "outcome"))
        self.input_tokens = r.counter(P + "input_tokens_total", "In.", ("tenant", "model"))
        self.output_tokens = r.counter(P + "output_tokens_total", "Out.", ("tenant", "model"))
        self.ttft = r.histogram(P + "ttft_seconds", "TTFT.", SLO, LATENCY_BUCKETS)
        self.tpot = r.histogram(P + "tpot_seconds", "TPOT.", SLO, TOKEN_BUCKETS)
        self.itl = r.histogram(P + "itl_seconds", "ITL.", SLO, TOKEN_BUCKETS)
        self.e2e = r.histogram(P + "e2e_seconds", "E2E.", SLO, LATENCY_BUCKETS)
        self.queue_time = r.histogram(P + "queue_time_seconds", "Queue.", SLO, LATENCY_BUCKETS)
        self.genai = GenAiServer(r)
        self.genai_client = GenAiClient(r)

    def record(self, q: Req) -> None:
        labels = (q.tenant, MODEL, q.priority_class)
        self.responses.inc(ROUTE, q.tenant, "200")
        self.requests.inc(q.tenant, MODEL, "success")
        self.genai.ended(OPERATION, MODEL, q.e2e_s, "")
        self.queue_time.observe(q.queue_s, *labels)
        self.input_tokens.inc(q.tenant, MODEL, by=q.prompt)
        self.output_tokens.inc(q.tenant, MODEL, by=q.completion)
        self.genai_client.used(OPERATION, MODEL, q.prompt, q.completion)
        self.ttft.observe(q.ttft_s, *labels)
        self.e2e.observe(q.e2e_s, *labels)
        self.tpot.observe(q.tpot_s, *labels)
        self.genai.answered(OPERATION, MODEL, q.ttft_s, q.tpot_s)
        itl = self.itl.child(*labels)  # the relay keeps it and observes per chunk
        for gap in q.gaps:
            itl.observe(gap)

    def scrape(self) -> None:
        self.registry.render()


class SdkGateway:
    """The same instruments and calls on the OpenTelemetry SDK."""

    def __init__(self) -> None:
        self.reader = InMemoryMetricReader()
        meter = MeterProvider(metric_readers=[self.reader]).get_meter("sluice.bench")

        c = meter.create_counter
        self.responses = c(P + "responses")
        self.requests = c(P + "requests")
        self.input_tokens = c(P + "input_tokens")
        self.output_tokens = c(P + "output_tokens")
        h = meter.create_histogram
        self.ttft = h(P + "ttft_seconds", "s", explicit_bucket_boundaries_advisory=LATENCY_BUCKETS)
        self.tpot = h(P + "tpot_seconds", "s", explicit_bucket_boundaries_advisory=TOKEN_BUCKETS)
        self.itl = h(P + "itl_seconds", "s", explicit_bucket_boundaries_advisory=TOKEN_BUCKETS)
        self.e2e = h(P + "e2e_seconds", "s", explicit_bucket_boundaries_advisory=LATENCY_BUCKETS)
        self.queue_time = h(P + "queue_time_seconds", "s",
                            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS)
        self.duration = h("gen_ai.server.request.duration", "s",
                          explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
        self.genai_ttft = h("gen_ai.server.time_to_first_token", "s",
                            explicit_bucket_boundaries_advisory=TTFT_BUCKETS)
        self.genai_tpot = h("gen_ai.server.time_per_output_token", "s",
                            explicit_bucket_boundaries_advisory=TPOT_BUCKETS)
        self.token_usage = h("gen_ai.client.token.usage", "{token}",
                             explicit_bucket_boundaries_advisory=[float(b) for b in
                                                                  TOKEN_USAGE_BUCKETS])

    def record(self, q: Req) -> None:
        slo = {"tenant": q.tenant, "model": MODEL, "priority_class": q.priority_class}
        by_model = {"tenant": q.tenant, "model": MODEL}
        genai = {"gen_ai.operation.name": OPERATION, "gen_ai.provider.name": PROVIDER,
                 "gen_ai.request.model": MODEL}
        self.responses.add(1, {"route": ROUTE, "tenant": q.tenant, "status": "200"})
        self.requests.add(1, {"tenant": q.tenant, "model": MODEL, "outcome": "success"})
        self.duration.record(q.e2e_s, genai)
        self.queue_time.record(q.queue_s, slo)
        self.input_tokens.add(q.prompt, by_model)
        self.output_tokens.add(q.completion, by_model)
        self.token_usage.record(q.prompt, {**genai, "gen_ai.token.type": "input"})
        self.token_usage.record(q.completion, {**genai, "gen_ai.token.type": "output"})
        self.ttft.record(q.ttft_s, slo)
        self.e2e.record(q.e2e_s, slo)
        self.tpot.record(q.tpot_s, slo)
        self.genai_ttft.record(q.ttft_s, genai)
        self.genai_tpot.record(q.tpot_s, genai)
        for gap in q.gaps:
            self.itl.record(gap, slo)

    def scrape(self) -> None:
        self.reader.get_metrics_data()


def each(record: Callable[[Req], None], reqs: list[Req]) -> Callable[[], None]:
    def run() -> None:
        for q in reqs:
            record(q)
    return run


def timed(fn: Callable[[], None]) -> float:
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m telemetry.bench.metrics_cost",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--tenants", type=int, default=100)
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args(argv)
    reqs = requests(args.requests, args.tenants)
    prom, sdk = PromGateway(), SdkGateway()
    sides: dict[str, PromGateway | SdkGateway] = {"prometheus_client Registry": prom,
                                                  "OpenTelemetry SDK MeterProvider": sdk}
    record = dict.fromkeys(sides, float("inf"))
    scrape = dict.fromkeys(sides, float("inf"))
    for _ in range(args.passes):
        for name, side in sides.items():
            record[name] = min(record[name], timed(each(side.record, reqs)) / len(reqs))
    for _ in range(args.passes * 4):  # both now hold every tenant's series
        for name, side in sides.items():
            scrape[name] = min(scrape[name], timed(side.scrape))
    (a, b) = sides
    print(f"per gateway request ({args.requests} requests over {args.tenants} tenants; "
          f"4 counter adds, 9 histogram observations, {GAPS} ITL observations), best of "
          f"{args.passes}:")
    for name, s in record.items():
        print(f"  {name:<34} {s * 1e6:8.1f} µs")
    print(f"  ratio SDK / prometheus_client      {record[b] / record[a]:8.2f}")
    lines = len(prom.registry.render().splitlines())
    print(f"one scrape of the same registries ({args.tenants} tenants, {lines} lines of text): "
          "prometheus_client generate_latest (text) against the SDK's in-memory collect "
          "(MetricsData):")
    for name, s in scrape.items():
        print(f"  {name:<34} {s * 1e3:8.2f} ms")
    print(f"  ratio SDK / prometheus_client      {scrape[b] / scrape[a]:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
