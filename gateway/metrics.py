"""The gateway's metrics: per-request latencies and outcomes recorded as requests end,
plus gauges and counters read from live state at scrape time. ``docs/metrics.md`` defines
every one of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator

from policies.breaker import STATE_VALUE
from protocol.limits import ConnectionCounts
from protocol.offload import PoolSnapshot
from telemetry.genai import GenAiClient, GenAiServer
from telemetry.metrics import (
    CONTENT_TYPE,
    LATENCY_BUCKETS,
    TOKEN_BUCKETS,
    Family,
    Kind,
    Registry,
    pool_families,
)
from telemetry.pauses import Pauses

from .admission import AdmissionSnapshot
from .pool import Member
from .queue import QueueSnapshot
from .upstream import UpstreamSnapshot
from .usage import LedgerSnapshot

__all__ = ["CONTENT_TYPE", "GatewayMetrics"]

P = "sluice_gateway_"
CUT_HELP = ("Requests and connections the HTTP layer cut or refused (protocol/server.py), by "
            "reason: head_timeout, body_timeout (408), head_too_large, trailers_too_large "
            "(431), too_many_connections (503), bad_request (400), idle (closed silently: no "
            "request byte within request_read_s).")
SLO_LABELS = ("tenant", "model", "priority_class")


class GatewayMetrics:
    def __init__(self, registry: Registry | None = None) -> None:
        r = self.registry = registry or Registry()
        self.inflight = 0
        self.responses = r.counter(P + "responses_total",
                                   "Responses sent, by route, tenant and status.",
                                   ("route", "tenant", "status"))
        self.requests = r.counter(P + "requests_total",
                                  "Generation requests by final outcome.",
                                  ("tenant", "model", "outcome"))
        self.rejected = r.counter(P + "rejected_total",
                                  "Requests the gateway refused, by reason (the quota hit or "
                                  "the error code).", ("tenant", "reason"))
        self.input_tokens = r.counter(P + "input_tokens_total",
                                      "Prompt tokens of settled requests.", ("tenant", "model"))
        self.output_tokens = r.counter(P + "output_tokens_total",
                                       "Completion tokens of settled requests.",
                                       ("tenant", "model"))
        self.ttft = r.histogram(P + "ttft_seconds", "Time to first token: request received "
                                "to first content chunk relayed.", SLO_LABELS, LATENCY_BUCKETS)
        self.tpot = r.histogram(P + "tpot_seconds", "Time per output token: (t_last - t_first)"
                                " / (output tokens - 1); none for one-token answers.",
                                SLO_LABELS, TOKEN_BUCKETS)
        self.itl = r.histogram(P + "itl_seconds", "Inter-token latency: gap between "
                               "consecutive content chunks relayed.", SLO_LABELS, TOKEN_BUCKETS)
        self.e2e = r.histogram(P + "e2e_seconds", "End to end: request received to response "
                               "ended, successful requests.", SLO_LABELS, LATENCY_BUCKETS)
        self.queue_time = r.histogram(P + "queue_time_seconds", "Time waiting for upstream "
                                      "capacity in the gateway's queue.", SLO_LABELS,
                                      LATENCY_BUCKETS)
        # the GenAI semantic conventions' (telemetry/genai.py): the gateway serves its
        # clients and is the client of its upstreams
        self.genai = GenAiServer(r)
        self.genai_client = GenAiClient(r)
        # resilience (docs/resilience.md): plain dicts, read at scrape time
        self.retries: dict[tuple[str, str], int] = {}  # (model, outcome) -> count
        self.failures: dict[tuple[str, str, str], int] = {}  # (model, upstream, reason)
        self.client_stalls = 0
        self._connections: Callable[[], Iterable[tuple[str, int]]] = \
            ConnectionCounts().snapshot  # the listener's, once bound
        self._state: tuple[Callable[[], LedgerSnapshot], Callable[[], list[UpstreamSnapshot]],
                           Callable[[], list[QueueSnapshot]],
                           Callable[[], AdmissionSnapshot]] | None = None
        r.collector(self._live)

    def count_retry(self, model: str, outcome: str) -> None:
        key = (model, outcome)
        self.retries[key] = self.retries.get(key, 0) + 1

    def count_failure(self, member: Member, reason: str) -> None:
        key = (member.model, member.url, reason)
        self.failures[key] = self.failures.get(key, 0) + 1

    def bind(self, ledger: Callable[[], LedgerSnapshot],
             upstreams: Callable[[], list[UpstreamSnapshot]],
             queues: Callable[[], list[QueueSnapshot]],
             admission: Callable[[], AdmissionSnapshot]) -> None:
        """Where the scrape-time values come from: the parts' snapshots."""
        self._state = (ledger, upstreams, queues, admission)

    def bind_tokenize(self, pool: Callable[[], PoolSnapshot], trims: Callable[[], int],
                      parsing: Callable[[], PoolSnapshot] | None = None) -> None:
        """The tokenize and parse pools' snapshots and the Trimmer's count, read at scrape
        time."""
        self.registry.collector(lambda: _tokenize(pool(), trims()))
        if parsing is not None:
            self.registry.collector(lambda: _parsing(parsing()))

    def bind_pauses(self, pauses: Pauses) -> None:
        """The process's collector passes and loop stalls, read at scrape time."""
        self.registry.collector(lambda: pauses.families(P))

    def bind_connections(self, snapshot: Callable[[], Iterable[tuple[str, int]]]) -> None:
        """Where the listener's cuts and refusals come from (``ConnectionCounts``)."""
        self._connections = snapshot

    def observe_response(self, route: str, tenant: str, status: int) -> None:
        self.responses.inc(route, tenant, str(status))

    def render(self) -> str:
        return self.registry.render()

    def _live(self) -> Iterator[Family]:
        yield Family(P + "inflight_requests", "gauge",
                     "Generation requests in flight.").add(self.inflight)
        yield _family(P + "connections_cut_total", "counter", CUT_HELP,
                      ((n, {"reason": r}) for r, n in self._connections()))
        if self._state is None:
            return
        ledger_of, upstreams_of, queues_of, admission_of = self._state
        ledger, ups, qs, adm = ledger_of(), upstreams_of(), queues_of(), admission_of()
        yield _family(P + "requests_settled_total", "counter", "Settled generation requests.",
                      ((n, {"tenant": t, "model": m, "outcome": o})
                       for t, m, o, n in ledger.settled))
        tokens = Family(P + "tokens_total", "counter", "Settled tokens per tenant.")
        for tenant, prompt, completion in ledger.tokens:
            tokens.add(prompt, tenant=tenant, type="prompt")
            tokens.add(completion, tenant=tenant, type="completion")
        yield tokens
        yield _family(P + "upstream_ready", "gauge", "Whether the upstream's versions are known.",
                      ((1 if up.ready else 0, {"model": up.name}) for up in ups))
        yield _family(P + "queue_length", "gauge", "Requests waiting for upstream capacity.",
                      ((q.size, {"model": q.upstream}) for q in qs))
        yield _family(P + "slots_held", "gauge",
                      "Upstream slots (in-flight requests) this replica holds.",
                      ((q.slots_held, {"model": q.upstream}) for q in qs))
        yield _family(P + "release_events_subscribed", "gauge", "1 while other replicas' "
                      "releases wake the queue at once (0: it polls the shared gate).",
                      ((int(q.hears_releases), {"model": q.upstream}) for q in qs))
        yield _family(P + "upstream_inflight_tokens", "gauge", "Worst-case tokens (prompt + "
                      "max output) of the requests in flight to the upstream.",
                      ((q.held_tokens, {"model": q.upstream}) for q in qs))
        yield _family(P + "dispatched_total", "counter", "Requests dispatched from the queue.",
                      ((c, {"model": q.upstream, "tenant": t}) for q in qs
                       for t, c in sorted(q.dispatched)))
        yield _family(P + "rejects_total", "counter", "Requests refused by a tenant limit.",
                      ((n, {"tenant": t, "limit": lim}) for t, lim, n in adm.rejects))
        yield _family(P + "fail_open_total", "counter", "Requests admitted by the local share "
                      "while the quota store was unreachable.",
                      ((n, {"tenant": t}) for t, n in adm.fail_open))
        yield Family(P + "store_errors_total", "counter",
                     "Quota store calls that failed.").add(adm.store_errors)
        yield Family(P + "store_up", "gauge", "1 when the last quota-store call worked.").add(
            1 if adm.store_up else 0)
        yield Family(P + "leases_live", "gauge",
                     "Quota leases held by this replica.").add(adm.leases_live)
        beats, beat_s, longest = adm.renew_beats
        yield Family(P + "renew_beats_total", "counter",
                     "Renewal beats (every live lease and slot renewed).").add(beats)
        yield Family(P + "renew_beat_seconds_total", "counter",
                     "Time the renewal beats took.").add(beat_s)
        yield Family(P + "renew_longest_beat_seconds", "gauge",
                     "The longest renewal beat since the start.").add(longest)
        yield from _resilience(self, ups)


def _resilience(m: GatewayMetrics, ups: list[UpstreamSnapshot]) -> Iterator[Family]:
    members = [(up.name, mb) for up in ups for mb in up.members]
    yield _family(P + "breaker_state", "gauge", "Circuit breaker of each upstream server: "
                  "0 closed, 1 half-open, 2 open.",
                  ((STATE_VALUE[mb.breaker_state], {"model": n, "upstream": mb.url})
                   for n, mb in members))
    yield _family(P + "breaker_transitions_total", "counter", "Breaker moves, by the state "
                  "moved to.", ((c, {"model": n, "upstream": mb.url, "state": s})
                                for n, mb in members for s, c in mb.transitions))
    yield _family(P + "upstream_failures_total", "counter", "Attempts that failed because of "
                  "the server, by reason (connect, connect_timeout, first_byte_timeout, "
                  "idle_timeout, http_5xx, broken, disconnected).",
                  ((c, {"model": n, "upstream": u, "reason": r})
                   for (n, u, r), c in sorted(m.failures.items())))
    yield _family(P + "retries_total", "counter", "Retry decisions after a failed attempt: "
                  "retried, budget_exhausted, no_other_upstream, attempts_exhausted; "
                  "all_open counts requests refused because every server's breaker was open.",
                  ((c, {"model": n, "outcome": o}) for (n, o), c in sorted(m.retries.items())))
    yield _family(P + "upstream_connections", "gauge", "Connections to the server lent to "
                  "requests now.", ((mb.connections, {"model": n, "upstream": mb.url})
                                    for n, mb in members))
    yield Family(P + "client_stalls_total", "counter", "Requests cancelled because the client "
                 "read nothing for timeouts.client_stall_s.").add(m.client_stalls)
    yield Family(P + "asyncio_tasks", "gauge", "Tasks alive on the gateway's event loop (a "
                 "leak check: it returns to its idle value).").add(_tasks())


def _tokenize(pool: PoolSnapshot, trims: int) -> Iterator[Family]:
    yield from pool_families(P, pool, name="tokenize", jobs="Long prompts",
                             reasons=("tokenize_concurrency", "tokenizer_busy"))
    yield Family(P + "memory_trims_total", "counter", "Freed heap handed back to the system "
                 "after requests with a body of 1 MiB or more.").add(trims)


def _parsing(pool: PoolSnapshot) -> Iterator[Family]:
    yield from pool_families(P, pool, name="parse", jobs="Large request bodies",
                             reasons=("too_many_large_bodies", "large_bodies_busy"))


def _tasks() -> int:
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:  # scraped off the loop (tests render directly)
        return 0


def _family(name: str, kind: Kind, help_text: str,
            samples: Iterable[tuple[float, dict[str, str]]]) -> Family:
    fam = Family(name, kind, help_text)
    for value, labels in samples:
        fam.add(value, **labels)
    return fam
