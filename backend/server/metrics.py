"""The backend's metrics, on the ``telemetry`` registry: per-request latencies, outcomes and
tokens recorded as each request ends, plus the engine's gauges and counters read from its
snapshot at scrape time. Everything is prefixed ``sluice_backend_``; ``docs/metrics.md``
defines each one.

Latency definitions follow the capacity lesson: TTFT is request received → first token
sampled; TPOT = (t_last − t_first) / (N_out − 1), none for one-token answers; ITL is every
gap between consecutive output tokens; E2E is request received → response ended.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from backend.engine.outputs import EngineState, OutputDelta
from protocol.errors import ApiError
from protocol.limits import ConnectionCounts
from protocol.offload import PoolSnapshot
from telemetry.genai import GenAiServer, operation_name
from telemetry.metrics import (
    CONTENT_TYPE,
    LATENCY_BUCKETS,
    TOKEN_BUCKETS,
    Family,
    Kind,
    Registry,
    pool_families,
)

__all__ = ["CONTENT_TYPE", "PREFIX", "ServerMetrics", "error_type"]

PREFIX = "sluice_backend_"
CUT_HELP = ("Requests and connections the HTTP layer cut or refused (protocol/server.py), by "
            "reason: head_timeout, body_timeout (408), head_too_large, trailers_too_large "
            "(431), too_many_connections (503), bad_request (400), idle (closed silently: no "
            "request byte within request_read_s).")
SLO_LABELS = ("tenant", "model", "priority_class")


class ServerMetrics:
    def __init__(self, registry: Registry | None = None) -> None:
        r = self.registry = registry or Registry()
        h, c = r.histogram, r.counter
        # Labelled by who asked: the SLO view (tenant, model, priority class).
        self.ttft = h(PREFIX + "ttft_seconds", "Time to first token: request received to "
                      "first output token sampled.", SLO_LABELS, LATENCY_BUCKETS)
        self.tpot = h(PREFIX + "tpot_seconds", "Time per output token: (t_last - t_first) / "
                      "(output tokens - 1), successful requests; none for one-token answers.",
                      SLO_LABELS, TOKEN_BUCKETS)
        self.itl = h(PREFIX + "itl_seconds", "Inter-token latency: every gap between "
                     "consecutive output tokens of a request.", SLO_LABELS, TOKEN_BUCKETS)
        self.e2e = h(PREFIX + "e2e_seconds", "End to end: request received to response "
                     "ended, successful requests.", SLO_LABELS, LATENCY_BUCKETS)
        self.queue_time = h(PREFIX + "queue_time_seconds", "Time from arrival in the engine "
                            "to first scheduling.", SLO_LABELS, LATENCY_BUCKETS)
        self.requests = c(PREFIX + "requests_total", "Generation requests by outcome "
                          "(success, cancelled, error, invalid).", ("tenant", "model", "outcome"))
        self.input_tokens = c(PREFIX + "input_tokens_total",
                              "Prompt tokens of requests the engine ran.", ("tenant", "model"))
        self.output_tokens = c(PREFIX + "output_tokens_total",
                               "Output tokens of requests the engine ran.", ("tenant", "model"))
        # The engine-wide, unlabelled series (kept: dashboards and tests read them).
        self.engine_queue_time = h(PREFIX + "request_queue_time_seconds",
                                   "Time from arrival to first scheduling in the engine.")
        self.engine_ttft = h(PREFIX + "time_to_first_token_seconds",
                             "Time from arrival in the engine to the first generated token.")
        self.engine_tpot = h(PREFIX + "time_per_output_token_seconds",
                             "Mean time between output tokens of a request (after the first).",
                             bounds=TOKEN_BUCKETS)
        self.engine_e2e = h(PREFIX + "request_latency_seconds",
                            "Time from arrival in the engine to the last token.")
        self.finished = c(PREFIX + "requests_finished_total", "Finished requests by reason.",
                          ("finish_reason",))
        self.prompt_tokens = c(PREFIX + "prompt_tokens_total",
                               "Prompt tokens of finished requests.")
        self.cached_tokens = c(PREFIX + "cached_prompt_tokens_total", "Prompt tokens of "
                               "finished requests served from the prefix cache.")
        self.generation_tokens = c(PREFIX + "generation_tokens_total",
                                   "Output tokens of finished requests.")
        self.disconnects = c(PREFIX + "client_disconnects_total",
                             "Requests aborted because the client went away.")
        self.http_requests = c(PREFIX + "http_requests_total",
                               "HTTP responses by route and status.", ("route", "status"))
        self.genai = GenAiServer(r)  # the GenAI semantic conventions' (telemetry/genai.py)
        for counter in (self.prompt_tokens, self.cached_tokens, self.generation_tokens,
                        self.disconnects):
            counter.inc(by=0)  # unlabelled: shown as 0 before the first request
        self._state: Callable[[], EngineState] | None = None
        self._inflight: Callable[[], int] = lambda: 0
        self._connections: Callable[[], Iterable[tuple[str, int]]] = \
            ConnectionCounts().snapshot  # the listener's, once bound
        r.collector(self._live)

    def bind(self, state: Callable[[], EngineState], inflight: Callable[[], int]) -> None:
        """Where the scrape-time values come from (the engine snapshot, in-flight count)."""
        self._state = state
        self._inflight = inflight

    def bind_tokenize(self, pool: Callable[[], PoolSnapshot], trims: Callable[[], int]) -> None:
        """The tokenize pool's snapshot and the Trimmer's count, read at scrape time."""
        self.registry.collector(lambda: _tokenize(pool(), trims()))

    def bind_connections(self, snapshot: Callable[[], Iterable[tuple[str, int]]]) -> None:
        """Where the listener's cuts and refusals come from (``ConnectionCounts``)."""
        self._connections = snapshot

    def observe_http(self, route: str, status: int) -> None:
        self.http_requests.inc(route, str(status))

    def observe_request(self, tenant: str, model: str, priority_class: str, outcome: str,
                        delta: OutputDelta | None, received: float, ended: float, *,
                        kind: str, error_type: str) -> None:
        """One generation request, once it has ended however it ended. ``received`` and
        ``ended`` are on the engine's clock; ``delta`` is its final output, if it ran;
        ``kind``: chat | completion; ``error_type``: empty for a success."""
        self.requests.inc(tenant, model, outcome)
        operation = operation_name(kind)
        e2e = ended - received
        self.genai.ended(operation, model, e2e, error_type)
        if delta is None:
            return
        self.finished.inc(delta.finish_reason or "unknown")
        self.prompt_tokens.inc(by=delta.num_prompt_tokens)
        self.cached_tokens.inc(by=delta.num_cached_tokens)
        self.generation_tokens.inc(by=delta.num_output_tokens)
        self.input_tokens.inc(tenant, model, by=delta.num_prompt_tokens)
        self.output_tokens.inc(tenant, model, by=delta.num_output_tokens)
        m = delta.metrics
        if m is None:
            return
        labels = (tenant, model, priority_class)
        if m.queue_time is not None:
            self.engine_queue_time.observe(m.queue_time)
            self.queue_time.observe(m.queue_time, *labels)
        if m.ttft is not None:
            self.engine_ttft.observe(m.ttft)
        times = m.token_times
        if not times:
            return
        ttft = times[0] - received
        self.ttft.observe(ttft, *labels)
        n = len(times)
        tpot = None
        if n >= 2:
            tpot = (times[-1] - times[0]) / (n - 1)
            self.engine_tpot.observe(tpot)
            if outcome == "success":
                self.tpot.observe(tpot, *labels)
            itl = self.itl.child(*labels)
            prev = times[0]
            for t in times[1:]:
                itl.observe(t - prev)
                prev = t
        if m.finished_time is not None:
            self.engine_e2e.observe(times[-1] - m.arrival_time)
        if outcome == "success":
            self.e2e.observe(e2e, *labels)
            self.genai.answered(operation, model, ttft, tpot)

    def render(self) -> str:
        return self.registry.render()

    def _live(self) -> Iterator[Family]:
        yield Family(PREFIX + "num_requests_inflight", "gauge",
                     "HTTP generation requests in flight.").add(self._inflight())
        cut = Family(PREFIX + "connections_cut_total", "counter", CUT_HELP)
        for reason, n in self._connections():
            cut.add(n, reason=reason)
        yield cut
        if self._state is None:
            return
        s = self._state()
        used = s.kv_blocks_total - s.kv_blocks_free

        def one(name: str, kind: Kind, help_text: str, value: float) -> Family:
            return Family(PREFIX + name, kind, help_text).add(value)

        yield one("kv_blocks_total", "gauge", "KV cache blocks in the pool.", s.kv_blocks_total)
        yield one("kv_blocks_used", "gauge", "KV cache blocks held by live requests.", used)
        yield one("kv_blocks_free", "gauge", "KV blocks free or cached-free.", s.kv_blocks_free)
        yield one("kv_blocks_cached", "gauge", "Free KV blocks that still hold a cached prefix.",
                  s.kv_blocks_cached)
        yield one("kv_cache_usage_ratio", "gauge", "Used KV blocks over total.",
                  used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        yield one("block_size", "gauge", "Tokens per KV block.", s.block_size)
        yield one("num_requests_running", "gauge", "Requests scheduled in the engine.",
                  s.running)
        yield one("num_requests_waiting", "gauge", "Requests queued in the engine.", s.waiting)
        yield one("preemptions_total", "counter", "Preemptions by recompute.", s.preemptions)
        yield one("prefix_cache_queries_total", "counter",
                  "Admissions that looked the prefix cache up.", s.prefix_cache_queries)
        yield one("prefix_cache_hits_total", "counter",
                  "Admissions that reused at least one cached block.", s.prefix_cache_hits)
        yield one("prefix_cache_hit_rate", "gauge", "Prefix-cache hits over queries "
                  "(admissions), since start; 0 before the first query.",
                  s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries
                  else 0.0)
        yield one("prefix_cache_query_tokens_total", "counter", "Prompt tokens looked up.",
                  s.prefix_cache_query_tokens)
        yield one("prefill_tokens_saved_total", "counter",
                  "Prompt tokens served from the cache.", s.prefill_tokens_saved)
        yield one("prefix_cache_evictions_total", "counter",
                  "Cached blocks evicted for reuse.", s.prefix_cache_evictions)
        yield one("engine_steps_total", "counter", "Engine iterations.", s.steps)
        yield one("engine_generated_tokens_total", "counter", "Tokens sampled by the engine.",
                  s.generated_tokens)
        yield one("engine_aborted_total", "counter", "Requests aborted in the engine.",
                  s.aborted)
        yield one("spec_decode_draft_tokens_total", "counter",
                  "Draft tokens proposed (speculative decoding).", s.spec_proposed_tokens)
        yield one("spec_decode_accepted_tokens_total", "counter",
                  "Draft tokens the target accepted.", s.spec_accepted_tokens)
        yield one("spec_decode_verify_steps_total", "counter",
                  "Sequence-steps that verified drafts.", s.spec_verify_steps)
        yield one("spec_decode_emitted_tokens_total", "counter",
                  "Tokens those sequence-steps produced (accepted drafts + one each).",
                  s.spec_emitted_tokens)
        yield one("spec_decode_acceptance_rate", "gauge",
                  "Accepted over proposed drafts since start; 0 before any.",
                  s.spec_acceptance_rate)
        yield one("spec_decode_tokens_per_step", "gauge", "Tokens per verifying "
                  "sequence-step since start (accepted + 1); 0 before any.",
                  s.spec_tokens_per_step)
        yield one("spec_decode_draft_seconds_total", "counter",
                  "Time spent drafting, in the engine's steps.", s.spec_draft_seconds)
        yield one("grammar_sequences", "gauge", "Choices decoding under a grammar "
                  "(response_format, tools) now.", s.grammar_sequences)
        yield one("grammar_compiles_total", "counter",
                  "Distinct grammars compiled by the engine.", s.grammar_compiles)
        yield one("grammar_cache_hits_total", "counter", "Constrained requests whose "
                  "grammar was compiled already.", s.grammar_cache_hits)


def _tokenize(pool: PoolSnapshot, trims: int) -> Iterator[Family]:
    yield from pool_families(PREFIX, pool, name="tokenize", jobs="Long prompts",
                             reasons=("tokenize_concurrency", "tokenizer_busy"))
    yield Family(PREFIX + "memory_trims_total", "counter", "Freed heap handed back to the "
                 "system after requests with a body of 1 MiB or more.").add(trims)


def error_type(outcome: str, error: ApiError | None) -> str:
    """``error.type`` of a request: empty for a success, else the error's code (its type
    when it has none), as the request's span says, else the outcome (``cancelled``)."""
    if outcome == "success":
        return ""
    if error is not None:
        return error.code or error.type
    return outcome
