"""The gateway's long-lived state and the request path up to the upstream call.

``Gateway`` is built in the Starlette lifespan and handed to the endpoints; it holds the
config, the key ring, the upstreams, the usage ledger and the metrics. ``Gateway.prepare``
turns an authenticated body into a ``Prepared`` request: model resolved and pinned, versions
snapshotted, features checked, priority and caps applied, prompt tokens counted, and the
exact body the upstream will get.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
from opentelemetry import trace

from policies.degrade import decide
from policies.retry_budget import RetryBudget, RetryPolicy
from telemetry import Telemetry

from .admission import Admission
from .config import GatewayConfig, TenantsFile
from .contract import ChatRequest, CompletionRequest, Kind, check_capabilities, parse
from .errors import (
    BadRequest,
    ModelNotFound,
    PayloadTooLarge,
    PermissionDenied,
    RevisionMismatch,
    ServiceUnavailable,
)
from .metrics import GatewayMetrics
from .queue import DispatchQueue
from .registry import Registry
from .stamp import Stamp
from .tenants import Tenant
from .upstream import Upstream, UpstreamError
from .usage import UsageLedger

log = logging.getLogger("sluice.gateway")

UNREACHABLE_RETRY_AFTER_S = 1.0


@dataclass(slots=True)
class Prepared:
    kind: Kind
    request_id: str
    tenant: Tenant
    upstream: Upstream
    stamp: Stamp
    stream: bool
    client_usage: bool  # the client asked for the usage chunk
    client_continuous: bool  # … and for running usage on every chunk
    priority: int
    prompt_tokens: int  # exact, or the documented upper bound for a byte-counted model
    prompt_exact: bool
    max_tokens: int | None  # the limit the upstream gets (None: the upstream's default)
    body: dict[str, Any]  # what the upstream gets
    pin: str | None = None  # the revision the client pinned, if any
    worst_case: int = 0  # prompt + the most tokens it may generate: what admission reserves
    clamped: str | None = None  # x-sluice-clamped value
    deadline: float | None = None  # monotonic time the client gives up at
    total_timeout: bool = False  # the deadline is the gateway's timeouts.total_s
    degraded: str | None = None  # x-sluice-degraded: the degradation applied, if any
    received: float = field(default_factory=time.monotonic)


class Gateway:
    def __init__(self, config: GatewayConfig, tenants: TenantsFile,
                 transport: httpx.AsyncBaseTransport | None = None,
                 telemetry: Telemetry | None = None) -> None:
        self.config = config
        self.registry = Registry(config, tenants)  # live: the admin API changes it
        self.upstreams: dict[str, Upstream] = {
            m.name: Upstream(m, config, transport) for m in config.models}
        self.ledger = UsageLedger()
        # Telemetry first: the metrics live in its registry (Prometheus and OTLP read it).
        self.telemetry = telemetry or Telemetry.create("sluice-gateway", config.telemetry,
                                                       scope="sluice.gateway")
        self.tracer: trace.Tracer = self.telemetry.tracer
        self.metrics = GatewayMetrics(self.telemetry.registry)
        self.admission = Admission(config)
        self.queues: dict[str, DispatchQueue] = {}
        for up in self.upstreams.values():
            for member in up.members:  # the capacity gate applies to each server of a pool
                q = DispatchQueue(member.key, self.admission.gate, member.limits,
                                  max_len=config.queue.max_len, aging_s=config.queue.aging_s,
                                  reserve_share=config.queue.reserve_share,
                                  reserve_priority=config.queue.reserve_priority,
                                  slot_ttl_s=config.admission.lease_ttl_s,
                                  replicas=config.store.replicas)
                self.queues[member.key] = q
                self.admission.renew_hooks.append(q.renew_all)
        r = config.resilience.retry
        self.retry_budget = RetryBudget(RetryPolicy(
            r.max_attempts, r.budget_ratio, r.budget_min_per_s, backoff_base_s=r.backoff_base_s,
            backoff_max_s=r.backoff_max_s))
        self.metrics.bind(self.ledger, self.upstreams, self.queues, self.admission)
        self.created = int(time.time())
        self._refreshing: dict[str, asyncio.Task[None]] = {}
        self._refresher: asyncio.Task[None] | None = None

    # ---- upstream versions ----------------------------------------------------------------
    async def refresh_all(self) -> None:
        for up in self.upstreams.values():
            try:
                await self.refresh(up)
            except UpstreamError as exc:
                log.warning("model %s: %s", up.name, exc)

    async def refresh(self, up: Upstream) -> None:
        """Refresh ``up`` once even when many requests ask at the same time."""
        task = self._refreshing.get(up.name)
        if task is None or task.done():
            task = asyncio.ensure_future(up.refresh())
            self._refreshing[up.name] = task
        # shield: a cancelled request must not cancel the refresh the others wait for
        await asyncio.shield(task)

    async def start(self) -> None:
        """Load tenants, read the upstreams' versions, start the background tasks."""
        await self.registry.start()
        await self.refresh_all()
        self.admission.start()
        self._refresher = asyncio.ensure_future(self._refresh_loop())

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_interval_s)
            await self.refresh_all()

    async def aclose(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        await self.registry.aclose()
        for q in self.queues.values():
            await q.aclose()
        await self.admission.aclose()
        for task in self._refreshing.values():
            task.cancel()
        await asyncio.gather(*self._refreshing.values(), return_exceptions=True)
        for up in self.upstreams.values():
            await up.aclose()
        # flushes queued spans and pushes the last metrics (blocking I/O: off the loop)
        await asyncio.to_thread(self.telemetry.shutdown)

    # ---- resolution -----------------------------------------------------------------------
    def resolve_model(self, tenant: Tenant, model: str) -> tuple[Upstream, str | None]:
        name, sep, pin = model.partition("@")
        if sep and not pin:
            raise BadRequest("a version pin is 'name@revision'; the revision is empty", "model",
                             code="invalid_value")
        up = self.upstreams.get(name)
        if up is None or not tenant.may_use(name):
            # Unknown and not-allowed look the same from outside: 404, naming what is allowed.
            allowed = sorted(n for n in self.upstreams if tenant.may_use(n))
            raise ModelNotFound(f"the model {name!r} does not exist or you do not have access "
                                f"to it; your models: {allowed}", "model")
        return up, (pin if sep else None)

    async def versions_of(self, up: Upstream) -> Any:
        if up.versions is None:
            try:
                await self.refresh(up)
            except UpstreamError as exc:
                raise ServiceUnavailable(f"the model {up.name!r} is not reachable right now",
                                         retry_after_s=UNREACHABLE_RETRY_AFTER_S) from exc
        assert up.versions is not None
        return up.versions

    def cache_salt(self, tenant: Tenant) -> str:
        """Separates tenants' prefix caches in the engine (no cross-tenant timing channel)."""
        return hashlib.sha256(b"sluice/cache-salt/v1\0" + tenant.id.encode()).hexdigest()[:32]

    async def prepare(self, kind: Kind, body: dict[str, Any], tenant: Tenant, request_id: str,
                      header_deadline_ms: int | None, stamp_out: list[Stamp]) -> Prepared:
        """Validate and resolve; ``stamp_out`` receives the stamp as soon as it is known, so
        that errors after resolution are stamped too."""
        req = parse(kind, body)
        up, pin = self.resolve_model(tenant, req.model)
        up, degraded = self._fallback(tenant, req.priority, up, pin)
        versions = await self.versions_of(up)
        stamp = Stamp(up.name, versions, tenant.policy_version)
        stamp_out.append(stamp)
        if pin is not None and not versions.revision_matches(pin):
            raise RevisionMismatch(f"the model {up.name!r} is served at revision "
                                   f"{versions.revision[:12]!r}, not {pin!r}")
        check_capabilities(req, up.name, up.capabilities)

        pr = tenant.priority
        priority = pr.default if req.priority is None else req.priority
        if not pr.min <= priority <= pr.max:
            raise PermissionDenied(f"priority {priority} is outside your range "
                                   f"[{pr.min}, {pr.max}] (lower is more urgent)", "priority")

        deadline_ms = req.deadline_ms if req.deadline_ms is not None else header_deadline_ms
        payload: Any = req.messages if isinstance(req, ChatRequest) else req.prompt
        tools = req.tools if isinstance(req, ChatRequest) else None
        prompt_tokens = await up.counter.count(kind, payload, tools)
        caps = tenant.caps
        if caps.max_prompt_tokens is not None and prompt_tokens > caps.max_prompt_tokens:
            how = "" if up.counter.exact else " (an upper bound: this model's tokens are " \
                                              "estimated from UTF-8 bytes)"
            raise PayloadTooLarge(f"the prompt has {prompt_tokens} tokens{how}; your limit is "
                                  f"{caps.max_prompt_tokens}",
                                  "messages" if kind == "chat" else "prompt",
                                  code="prompt_too_long")
        if up.max_model_len is not None and up.counter.exact \
                and prompt_tokens >= up.max_model_len:
            raise BadRequest(f"this model's maximum context length is {up.max_model_len} "
                             f"tokens; the prompt has {prompt_tokens}",
                             "messages" if kind == "chat" else "prompt",
                             code="context_length_exceeded")

        out = dict(body)
        out["model"] = up.served_name
        out.pop("deadline_ms", None)
        out.pop("priority", None)
        if "priority" in up.capabilities:
            out["priority"] = priority
        if "cache_salt" in up.capabilities:
            out["cache_salt"] = self.cache_salt(tenant)
        max_tokens, clamped = self._limit_tokens(req, out, tenant)
        if degraded is None and tenant.degrade is not None:
            max_tokens, degraded = self._degrade(tenant, priority, up, max_tokens, out)
        stream = bool(req.stream)
        opts = req.stream_options
        client_usage = bool(opts and opts.include_usage)
        client_continuous = bool(opts and opts.continuous_usage_stats)
        if stream:
            # Always ask for usage so the gateway knows exact counts; running counts too where
            # the upstream can, so a cancelled stream still settles exactly.
            wanted: dict[str, Any] = {"include_usage": True}
            if "continuous_usage_stats" in up.capabilities:
                wanted["continuous_usage_stats"] = True
            out["stream_options"] = wanted
        if max_tokens is not None:
            generated = max_tokens
        elif up.max_model_len is not None and up.counter.exact:
            generated = max(1, up.max_model_len - prompt_tokens)
        else:
            generated = self.config.admission.default_max_tokens
        return Prepared(
            worst_case=prompt_tokens + generated,
            kind=kind, request_id=request_id, tenant=tenant, upstream=up, stamp=stamp,
            stream=stream, client_usage=client_usage, client_continuous=client_continuous,
            priority=priority, prompt_tokens=prompt_tokens, prompt_exact=up.counter.exact,
            max_tokens=max_tokens, body=out, pin=pin, clamped=clamped, degraded=degraded,
            **self._deadline(deadline_ms))

    # ---- degradation (policies/degrade.py) -------------------------------------------------
    def load_of(self, up: Upstream) -> float:
        """In-flight plus waiting worst-case tokens ÷ the pool's capacity (this replica's)."""
        used = cap = 0
        for m in up.members:
            q = self.queues[m.key]
            used += q.held_tokens + sum(w.tokens for d in q.waiting.values() for w in d)
            cap += m.limits()[0] or 0
        if cap == 0:
            return 1.0 if any(self.queues[m.key].size for m in up.members) else 0.0
        return used / cap

    def _fallback(self, tenant: Tenant, asked: int | None, up: Upstream,
                  pin: str | None) -> tuple[Upstream, str | None]:
        """The tenant's fallback model instead of ``up`` when ``up`` is overloaded."""
        rules = tenant.degrade
        if rules is None or rules.fallback_model is None or rules.fallback_model == up.name:
            return up, None
        fb = self.upstreams.get(rules.fallback_model)
        if fb is None or not tenant.may_use(fb.name):
            return up, None
        priority = tenant.priority.default if asked is None else asked
        d = decide(rules, priority, self.load_of(up), None, pinned=pin is not None)
        if d is None or d.action != "fallback":
            return up, None
        return fb, d.describe(model=up.name)

    def _degrade(self, tenant: Tenant, priority: int, up: Upstream, max_tokens: int | None,
                 out: dict[str, Any]) -> tuple[int | None, str | None]:
        """Shed (raises 503) or clamp a batch request under load; (max_tokens, note)."""
        assert tenant.degrade is not None
        rules = replace(tenant.degrade, fallback_model=None)
        d = decide(rules, priority, self.load_of(up), max_tokens)
        if d is None:
            return max_tokens, None
        if d.action == "shed":
            err = ServiceUnavailable(f"the model {up.name!r} is overloaded ({d.load:.0%} of "
                                     f"its capacity): batch requests are shed first",
                                     retry_after_s=1.0, code="degraded_shed")
            err.extra_headers.append((b"x-sluice-degraded", d.describe().encode()))
            raise err
        field_name = "max_completion_tokens" if "max_completion_tokens" in out \
            else "max_tokens"
        out[field_name] = d.max_tokens
        return d.max_tokens, d.describe(asked=max_tokens)

    def _deadline(self, deadline_ms: int | None) -> dict[str, Any]:
        """The client's deadline, or ``timeouts.total_s`` from now if that is sooner."""
        now = time.monotonic()
        total = self.config.timeouts.total_s
        client = None if deadline_ms is None else now + deadline_ms / 1000
        if total is not None and (client is None or now + total < client):
            return {"deadline": now + total, "total_timeout": True}
        return {"deadline": client, "total_timeout": False}

    @staticmethod
    def _limit_tokens(req: ChatRequest | CompletionRequest, out: dict[str, Any],
                      tenant: Tenant) -> tuple[int | None, str | None]:
        """Apply the tenant's max_tokens cap to ``out``; returns (limit, clamp note)."""
        field_name = "max_completion_tokens" if req.max_completion_tokens is not None \
            else "max_tokens"
        asked = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        cap = tenant.caps.max_tokens
        if cap is None:
            return asked, None
        if asked is None:
            # Absent means "as much as the context allows" upstream: the cap applies, and the
            # client is told, since the body now says something it did not.
            out["max_tokens"] = cap
            return cap, f"max_tokens={cap}; requested=unset"
        if asked <= cap:
            return asked, None
        if tenant.caps.on_exceed == "reject":
            raise BadRequest(f"{field_name}={asked} is over your limit of {cap}", field_name,
                             code="max_tokens_over_limit")
        out[field_name] = cap
        return cap, f"{field_name}={cap}; requested={asked}"
