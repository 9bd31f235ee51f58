"""The gateway's long-lived parts, and ``build_gateway``: the one place that builds them.

``build_gateway`` is the composition root. It builds the tenant registry, the upstreams
(with their pools, breakers and token counters), the usage ledger, telemetry and the
metrics, admission (quota store, capacity gate), one dispatch queue per pool member, the
retry budget and the request resolver, and hands each only the collaborators it needs.
The Starlette lifespan calls it and keeps the ``Gateway`` on ``app.state.gateway``;
``Gateway.start`` and ``Gateway.aclose`` own the background tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx
from opentelemetry import trace

from policies.retry_budget import RetryBudget, RetryPolicy
from protocol.large_bodies import parse_pool
from protocol.memory import Trimmer
from protocol.offload import TokenizePool, WorkPool
from telemetry import Telemetry
from telemetry.pauses import Pauses

from .admission import Admission
from .cache_salt import CacheSalter
from .config import GatewayConfig, TenantsFile
from .metrics import GatewayMetrics
from .queue import DispatchQueue, hear_releases
from .registry import Registry
from .resolve import Resolver
from .upstream import Upstream, UpstreamError
from .usage import UsageLedger

if TYPE_CHECKING:
    from policies.release_events import ReleaseEvents

log = logging.getLogger("sluice.gateway")


class Refresher:
    """Re-reads what each upstream serves, member by member (``Upstream.refresh``): at
    start, every ``refresh_interval_s``, and on demand (a request that finds the versions
    unknown, or an answer naming versions its member was not known to serve). Concurrent
    demands for one upstream share one refresh."""

    def __init__(self, upstreams: Mapping[str, Upstream], interval_s: float) -> None:
        self.upstreams = upstreams
        self.interval_s = interval_s
        self._refreshing: dict[str, asyncio.Task[None]] = {}
        self._loop: asyncio.Task[None] | None = None

    async def refresh(self, up: Upstream) -> None:
        """Refresh ``up`` once even when many requests ask at the same time."""
        task = self._refreshing.get(up.name)
        if task is None or task.done():
            task = asyncio.ensure_future(up.refresh())
            self._refreshing[up.name] = task
        # shield: a cancelled request must not cancel the refresh the others wait for
        await asyncio.shield(task)

    async def refresh_all(self) -> None:
        for up in self.upstreams.values():
            try:
                await self.refresh(up)
            except UpstreamError as exc:
                log.warning("model %s: %s", up.name, exc)

    def start(self) -> None:
        self._loop = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.refresh_all()

    async def aclose(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
        for task in self._refreshing.values():
            task.cancel()
        await asyncio.gather(*self._refreshing.values(), return_exceptions=True)


def pool_load(up: Upstream, queues: Mapping[str, DispatchQueue]) -> float:
    """In-flight plus waiting worst-case tokens ÷ the pool's capacity (this replica's)."""
    used = cap = waiting = 0
    for m in up.members:
        queue = queues[m.key]
        used += queue.load_tokens()
        waiting += queue.size
        cap += m.limits()[0] or 0
    if cap == 0:
        return 1.0 if waiting else 0.0
    return used / cap


@dataclass(slots=True, eq=False)
class Gateway:
    """Everything a request uses, built once by ``build_gateway``."""

    config: GatewayConfig
    registry: Registry  # live: the admin API changes it
    upstreams: dict[str, Upstream]
    refresher: Refresher
    ledger: UsageLedger
    telemetry: Telemetry
    metrics: GatewayMetrics
    admission: Admission
    queues: dict[str, DispatchQueue]  # one per pool member, by member key
    retry_budget: RetryBudget
    resolver: Resolver
    tokenize_pool: TokenizePool  # long prompts of local tokenizers, off the event loop
    parse_pool: WorkPool  # large bodies parsed in a worker process, tenants in turn
    trimmer: Trimmer = field(default_factory=Trimmer)  # memory back after large bodies
    pauses: Pauses = field(default_factory=Pauses)  # collector passes and loop stalls
    created: int = field(default_factory=lambda: int(time.time()))
    release_events: ReleaseEvents | None = None  # wakes the queues on other replicas' releases

    @property
    def tracer(self) -> trace.Tracer:
        return self.telemetry.tracer

    async def refresh(self, up: Upstream) -> None:
        await self.refresher.refresh(up)

    async def start(self) -> None:
        """Load tenants, read the upstreams' versions, start the background tasks."""
        await self.registry.start()
        await self.refresher.refresh_all()
        self.admission.start()
        if self.release_events is not None:
            self.release_events.start()
        self.refresher.start()
        self.trimmer.start()
        self.pauses.start()
        self.metrics.bind_pauses(self.pauses)

    async def aclose(self) -> None:
        await self.refresher.aclose()
        await self.registry.aclose()
        if self.release_events is not None:
            await self.release_events.aclose()
        for q in self.queues.values():
            await q.aclose()
        await self.admission.aclose()
        for up in self.upstreams.values():
            await up.aclose()
        self.tokenize_pool.close()
        self.parse_pool.close()
        await self.trimmer.aclose()
        await self.pauses.aclose()
        # flushes queued spans and pushes the last metrics (blocking I/O: off the loop)
        await asyncio.to_thread(self.telemetry.shutdown)


def build_gateway(config: GatewayConfig, tenants: TenantsFile,
                  transport: httpx.AsyncBaseTransport | None = None,
                  telemetry: Telemetry | None = None,
                  salter: CacheSalter | None = None) -> Gateway:
    """Build every part and wire it; ``transport`` replaces httpx's network (tests);
    ``salter`` derives the tenants' cache_salt (default: a random key for this process)."""
    tokenize_pool = TokenizePool(config.tokenize.settings())
    upstreams = {m.name: Upstream(m, config, transport, tokenize_pool) for m in config.models}
    refresher = Refresher(upstreams, config.refresh_interval_s)
    # Telemetry first: the metrics live in its registry (Prometheus and OTLP read it).
    telemetry = telemetry or Telemetry.create("sluice-gateway", config.telemetry,
                                              scope="sluice.gateway")
    metrics = GatewayMetrics(telemetry.registry)
    with contextlib.suppress(RuntimeError):  # built on its loop: the OTLP push reads there
        telemetry.registry.bind_loop(asyncio.get_running_loop())
    admission = Admission(config)
    queues: dict[str, DispatchQueue] = {}
    q = config.queue
    for up in upstreams.values():
        for member in up.members:  # the capacity gate applies to each server of a pool
            queue = DispatchQueue(member.key, admission.gate, member.limits, max_len=q.max_len,
                                  aging_s=q.aging_s, reserve_share=q.reserve_share,
                                  reserve_priority=q.reserve_priority,
                                  slot_ttl_s=config.admission.lease_ttl_s,
                                  replicas=config.store.replicas)
            queues[member.key] = queue
            admission.renew_hooks.append(queue.renew_all)
    release_events = hear_releases(queues, admission.gate)  # None: no gate shared
    r = config.resilience.retry
    budget = RetryBudget(RetryPolicy(r.max_attempts, r.budget_ratio, r.budget_min_per_s,
                                     backoff_base_s=r.backoff_base_s,
                                     backoff_max_s=r.backoff_max_s))
    ledger = UsageLedger()
    metrics.bind(ledger.snapshot, lambda: [u.snapshot() for u in upstreams.values()],
                 lambda: [queue.snapshot() for _, queue in sorted(queues.items())],
                 admission.snapshot)
    trimmer = Trimmer()
    parsing = parse_pool()
    metrics.bind_tokenize(tokenize_pool.snapshot, lambda: trimmer.trims, parsing.snapshot)
    resolver = Resolver(config, upstreams, refresher.refresh, lambda up: pool_load(up, queues),
                        salter=salter)
    return Gateway(config=config, registry=Registry(config, tenants), upstreams=upstreams,
                   refresher=refresher, ledger=ledger, telemetry=telemetry, metrics=metrics,
                   admission=admission, queues=queues, retry_budget=budget, resolver=resolver,
                   tokenize_pool=tokenize_pool, trimmer=trimmer, parse_pool=parsing,
                   release_events=release_events)
