"""Prometheus text exposition (format 0.0.4), written by hand: a few counters and
histograms fed per finished request, plus gauges read from the engine's snapshot at scrape.
"""

from __future__ import annotations

import bisect
from collections import Counter

from backend.engine.outputs import EngineState, OutputDelta

PREFIX = "sluice_backend_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds. Queue time and TTFT span a millisecond to minutes; TPOT is per token.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25,
                0.5, 1.0, 2.5)


class Histogram:
    """Cumulative-bucket histogram; observe() is O(log buckets)."""

    __slots__ = ("bounds", "count", "counts", "help", "name", "sum")

    def __init__(self, name: str, help_text: str, bounds: tuple[float, ...]) -> None:
        self.name = name
        self.help = help_text
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last slot: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, out: list[str]) -> None:
        out.append(f"# HELP {self.name} {self.help}")
        out.append(f"# TYPE {self.name} histogram")
        acc = 0
        for bound, n in zip(self.bounds, self.counts):
            acc += n
            out.append(f'{self.name}_bucket{{le="{bound}"}} {acc}')
        out.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{self.name}_sum {self.sum}")
        out.append(f"{self.name}_count {self.count}")


class ServerMetrics:
    """Per-request observations; engine gauges and counters come from its snapshot."""

    def __init__(self) -> None:
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds",
                                    "Time from arrival to first scheduling in the engine.",
                                    LATENCY_BUCKETS)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time from arrival to the first generated token.",
                              LATENCY_BUCKETS)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "Mean time between output tokens of a request (after the first).",
                              TPOT_BUCKETS)
        self.e2e = Histogram(PREFIX + "request_latency_seconds",
                             "Time from arrival to the last token.", LATENCY_BUCKETS)
        self.finished: Counter[str] = Counter()
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generation_tokens = 0
        self.http_requests: Counter[tuple[str, int]] = Counter()
        self.disconnects = 0

    def observe_finished(self, delta: OutputDelta) -> None:
        self.finished[delta.finish_reason or "unknown"] += 1
        self.prompt_tokens += delta.num_prompt_tokens
        self.cached_tokens += delta.num_cached_tokens
        self.generation_tokens += delta.num_output_tokens
        m = delta.metrics
        if m is None:
            return
        if m.queue_time is not None:
            self.queue_time.observe(m.queue_time)
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        times = m.token_times
        if len(times) >= 2:
            self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))
        if m.finished_time is not None and times:
            self.e2e.observe(times[-1] - m.arrival_time)

    def observe_http(self, route: str, status: int) -> None:
        self.http_requests[(route, status)] += 1

    def render(self, state: EngineState, inflight: int) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str, value: float,
                   labels: str = "") -> None:
            out.append(f"# HELP {PREFIX}{name} {help_text}")
            out.append(f"# TYPE {PREFIX}{name} {kind}")
            out.append(f"{PREFIX}{name}{labels} {value}")

        used = state.kv_blocks_total - state.kv_blocks_free
        metric("kv_blocks_total", "gauge", "KV cache blocks in the pool.", state.kv_blocks_total)
        metric("kv_blocks_used", "gauge", "KV cache blocks held by live requests.", used)
        metric("kv_blocks_free", "gauge", "KV blocks free or cached-free.", state.kv_blocks_free)
        metric("kv_blocks_cached", "gauge", "Free KV blocks that still hold a cached prefix.",
               state.kv_blocks_cached)
        metric("kv_cache_usage_ratio", "gauge", "Used KV blocks over total.",
               used / state.kv_blocks_total if state.kv_blocks_total else 0.0)
        metric("block_size", "gauge", "Tokens per KV block.", state.block_size)
        metric("num_requests_running", "gauge", "Requests scheduled in the engine.",
               state.running)
        metric("num_requests_waiting", "gauge", "Requests queued in the engine.", state.waiting)
        metric("num_requests_inflight", "gauge", "HTTP generation requests in flight.", inflight)
        metric("preemptions_total", "counter", "Preemptions by recompute.", state.preemptions)
        metric("prefix_cache_queries_total", "counter", "Admissions that looked the prefix cache up.",
               state.prefix_cache_queries)
        metric("prefix_cache_hits_total", "counter", "Admissions that reused at least one cached block.",
               state.prefix_cache_hits)
        metric("prefix_cache_query_tokens_total", "counter", "Prompt tokens looked up.",
               state.prefix_cache_query_tokens)
        metric("prefill_tokens_saved_total", "counter", "Prompt tokens served from the cache.",
               state.prefill_tokens_saved)
        metric("prefix_cache_evictions_total", "counter", "Cached blocks evicted for reuse.",
               state.prefix_cache_evictions)
        metric("engine_steps_total", "counter", "Engine iterations.", state.steps)
        metric("engine_generated_tokens_total", "counter", "Tokens sampled by the engine.",
               state.generated_tokens)
        metric("engine_aborted_total", "counter", "Requests aborted in the engine.",
               state.aborted)
        metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
               self.prompt_tokens)
        metric("cached_prompt_tokens_total", "counter",
               "Prompt tokens of finished requests served from the prefix cache.",
               self.cached_tokens)
        metric("generation_tokens_total", "counter", "Output tokens of finished requests.",
               self.generation_tokens)
        metric("client_disconnects_total", "counter",
               "Requests aborted because the client went away.", self.disconnects)
        out.append(f"# HELP {PREFIX}requests_finished_total Finished requests by reason.")
        out.append(f"# TYPE {PREFIX}requests_finished_total counter")
        for reason, n in sorted(self.finished.items()):
            out.append(f'{PREFIX}requests_finished_total{{finish_reason="{reason}"}} {n}')
        out.append(f"# HELP {PREFIX}http_requests_total HTTP responses by route and status.")
        out.append(f"# TYPE {PREFIX}http_requests_total counter")
        for (route, status), n in sorted(self.http_requests.items()):
            out.append(f'{PREFIX}http_requests_total{{route="{route}",status="{status}"}} {n}')
        for h in (self.queue_time, self.ttft, self.tpot, self.e2e):
            h.render(out)
        out.append("")
        return "\n".join(out)
