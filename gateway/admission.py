"""The gateway's side of admission: reserve the worst case, keep the lease alive, settle.

    reserve  one atomic store call per request: prompt + max_tokens from every budget of the
             tenant, plus a concurrency lease with a TTL. Denied: 429 naming the limit, with
             Retry-After computed by the store (bucket refill, period end, or the running
             request's predicted end for max_concurrency: policies/hold.py).
    renew    one background task renews every live lease each ``lease_ttl_s / 3`` seconds,
             so a long stream keeps its lease and a killed replica's leases expire.
    settle   however the request ends, in a task the ``Admission`` owns (a cancelled request
             cannot cancel its own settlement): actual = prompt + generated; the store
             refunds the rest, idempotently by request id.

When the store cannot be reached, the tenant's ``fail_mode`` decides: ``closed`` answers 503
with Retry-After; ``open`` admits against a local in-memory store holding limit ÷ replicas
(``policies.local_share``: a ``MemoryStore``, not aiolimiter, for the reasons and the side-by-
side test named there), counted in ``sluice_gateway_fail_open_total`` and logged — never
silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from policies.capacity import CapacityGate, MemoryGate
from policies.local_share import local_share
from policies.memory import MemoryStore
from policies.quotas import Decision
from policies.store import RENEW_BATCH, Store, StoreError, StoreUnavailable
from protocol.errors import RateLimited

from .config import GatewayConfig
from .errors import GatewayError, ServiceUnavailable
from .tenants import Tenant
from .tracing import NO_TRACE, RESERVE, SETTLE, NoTrace, reject_reason

log = logging.getLogger("sluice.gateway.admission")

NO_RETRY_AFTER_S = 120.0  # past this wait, x-should-retry: false
STORE_RETRY_AFTER_S = 1.0
UNDO_AGAIN_S = 1.0  # a second try at undoing a timed-out reserve (it may land late)
_LOG_EVERY_S = 10.0


_LIMIT_WORDS = {
    "tokens_per_minute": "tokens per minute",
    "requests_per_minute": "requests per minute",
    "tokens_per_day": "tokens per day",
    "tokens_per_month": "tokens per month",
    "max_concurrency": "concurrent requests",
}


@dataclass(slots=True, frozen=True)
class Ticket:
    """A granted reservation: what to settle, where."""

    tenant: str
    request_id: str
    tokens: int
    store: Store
    decision: Decision
    local: bool  # admitted by the fail-open local share


@dataclass(slots=True, frozen=True)
class AdmissionSnapshot:
    """What the metrics read of admission, at scrape time."""

    rejects: tuple[tuple[str, str, int], ...]  # (tenant, limit, count), sorted
    fail_open: tuple[tuple[str, int], ...]  # (tenant, requests admitted by the local share)
    store_errors: int
    store_up: bool
    leases_live: int
    renew_beats: tuple[int, float, float] = (0, 0.0, 0.0)  # beats, seconds, the longest


class Reservation:
    """One request's reservation, from its grant to its settlement; traced as the
    ``sluice.admission.reserve`` phase span (the grant) and the ``sluice.settle`` event.

    The grant is shielded: a client leaving mid-call must not leave a granted reservation
    behind, so one that lands after the caller left is settled at zero instead."""

    __slots__ = ("_admission", "_completion", "_prompt", "_request_id", "_tenant",
                 "_terms", "_tokens", "_trace", "ticket")

    def __init__(self, admission: Admission, tenant: Tenant, request_id: str, tokens: int,
                 trace: NoTrace, terms: str = "") -> None:
        self._admission = admission
        self._terms = terms
        self._tenant = tenant
        self._request_id = request_id
        self._tokens = tokens
        self._trace = trace
        self._prompt = self._completion = 0
        self.ticket: Ticket | None = None

    def settle_at(self, prompt_tokens: int, completion_tokens: int) -> None:
        """What the request used: its settlement, when the block ends."""
        self._prompt, self._completion = prompt_tokens, completion_tokens

    async def __aenter__(self) -> Ticket:
        adm, trace = self._admission, self._trace
        span = trace.start(RESERVE, {"sluice.reserved_tokens": self._tokens})
        call = asyncio.ensure_future(adm.grant(self._tenant, self._request_id, self._tokens,
                                               terms=self._terms))
        try:
            ticket = await asyncio.shield(call)
        except GatewayError as err:
            trace.end(span, **{"sluice.granted": False, "error.type": reject_reason(err)})
            raise
        except BaseException as exc:
            trace.end(span, **{"sluice.granted": False})
            if isinstance(exc, asyncio.CancelledError):
                call.add_done_callback(adm.undo_grant)
            raise
        trace.end(span, **{"sluice.granted": True, "sluice.fail_open": ticket.local})
        self.ticket = ticket
        return ticket

    async def __aexit__(self, *exc: object) -> None:
        if self.ticket is None:
            return
        trace = self._trace
        trace.event(SETTLE, **{"gen_ai.usage.input_tokens": self._prompt,
                               "gen_ai.usage.output_tokens": self._completion})
        self._admission.settle(self.ticket, self._prompt + self._completion)


def build_store(config: GatewayConfig) -> Store:
    if config.store.url is None:
        return MemoryStore()
    from policies.redis_store import RedisStore

    return RedisStore(config.store.url, timeout_s=config.store.timeout_s,
                      cluster=config.store.cluster)


def build_gate(store: Store) -> CapacityGate:
    """The capacity gate lives where the quotas live: shared through Redis, or local."""
    from policies.redis_store import RedisStore

    if isinstance(store, RedisStore):
        from policies.capacity import RedisGate

        return RedisGate(store.client, deadline_s=store.deadline_s, cluster=store.cluster,
                         permits=store.permits)
    return MemoryGate()


class Admission:
    def __init__(self, config: GatewayConfig, store: Store | None = None) -> None:
        self.config = config
        self.store = store or build_store(config)
        self.gate = build_gate(self.store)
        self.local = MemoryStore()
        # more leases to renew on the same beat (the queues' capacity slots)
        self.renew_hooks: list[Callable[[], Awaitable[None]]] = []
        self.lease_ttl_s = config.admission.lease_ttl_s
        self.replicas = config.store.replicas
        self.live: dict[str, Ticket] = {}
        self.fail_open: dict[str, int] = {}  # tenant -> requests admitted by the local share
        self.store_errors = 0
        self.store_up = True  # the last quota-store call worked (a gauge for operators)
        self.rejects: dict[tuple[str, str], int] = {}  # (tenant, limit) -> count
        self._settling: set[asyncio.Task[None]] = set()
        self._renewer: asyncio.Task[None] | None = None
        self.beats, self.beat_s, self.longest_beat = 0, 0.0, 0.0  # renewal beats, timed
        self._last_log = 0.0

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self._renewer = asyncio.ensure_future(self._renew_loop())

    async def aclose(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
        if self._settling:
            await asyncio.wait(self._settling, timeout=5.0)
        await self.store.close()

    def snapshot(self) -> AdmissionSnapshot:
        return AdmissionSnapshot(
            rejects=tuple((t, lim, n) for (t, lim), n in sorted(self.rejects.items())),
            fail_open=tuple(sorted(self.fail_open.items())), store_errors=self.store_errors,
            store_up=self.store_up, leases_live=len(self.live),
            renew_beats=(self.beats, self.beat_s, self.longest_beat))

    # ---- reserve --------------------------------------------------------------------------
    def reserve(self, tenant: Tenant, request_id: str, tokens: int,
                trace: NoTrace = NO_TRACE, terms: str = "") -> Reservation:
        """``async with reservation as ticket``: hold ``tokens`` in the tenant's budgets for
        the block, settled when it ends at what ``reservation.settle_at`` recorded (nothing
        recorded: nothing used). Entering raises a 429 / 503 ``GatewayError``
        when refused (nothing taken), naming ``terms`` (how ``tokens`` was worked out)."""
        return Reservation(self, tenant, request_id, tokens, trace, terms)

    async def grant(self, tenant: Tenant, request_id: str, tokens: int,
                    terms: str = "") -> Ticket:
        """A granted ticket, or a 429 / 503 ``GatewayError`` (nothing taken); the caller
        settles it (``reserve`` does)."""
        store: Store = self.store
        quotas = tenant.quotas
        local = False
        try:
            decision = await store.reserve(tenant.id, request_id, tokens, quotas,
                                           self.lease_ttl_s)
        except StoreUnavailable as exc:
            self.store_errors += 1
            self.store_up = False
            self._undo_lost(tenant.id, request_id)
            if tenant.fail_mode != "open":
                self._log_store_down(exc, tenant, "refusing (fail_mode closed)")
                raise ServiceUnavailable("admission is unavailable right now (quota store "
                                         "unreachable)", retry_after_s=STORE_RETRY_AFTER_S,
                                         code="store_unavailable") from None
            self._log_store_down(exc, tenant, "admitting within the local share "
                                              "(fail_mode open)")
            store, local = self.local, True
            quotas = local_share(quotas, self.replicas)
            decision = await store.reserve(tenant.id, request_id, tokens, quotas,
                                           self.lease_ttl_s)
            if decision.granted:
                self.fail_open[tenant.id] = self.fail_open.get(tenant.id, 0) + 1
        except StoreError as exc:  # a duplicate request id: a bug or a replayed id
            raise ServiceUnavailable(f"admission refused the request: {exc}",
                                     retry_after_s=STORE_RETRY_AFTER_S) from None
        if not local:
            self.store_up = True
        if not decision.granted:
            raise self._denial(tenant, decision, terms or str(tokens))
        ticket = Ticket(tenant.id, request_id, tokens, store, decision, local)
        self.live[request_id] = ticket
        return ticket

    def undo_grant(self, done: asyncio.Future[Ticket]) -> None:
        """A grant that landed after its caller left: settle it at zero."""
        if not done.cancelled() and done.exception() is None:
            self.settle(done.result(), 0)

    def _denial(self, tenant: Tenant, d: Decision, tokens: str) -> GatewayError:
        limit = d.denied_by or "quota"
        key = (tenant.id, limit)
        self.rejects[key] = self.rejects.get(key, 0) + 1
        words = _LIMIT_WORDS.get(limit, limit)
        value = getattr(tenant.quotas, limit, None)
        if d.retry_after_s is None:
            err = RateLimited(f"this request ({tokens} tokens at most) can never fit your "
                              f"limit of {value} {words}", limit, should_retry=False)
        else:
            wait = d.retry_after_s
            err = RateLimited(f"rate limit reached: {words} (limit {value}); this request "
                              f"({tokens} tokens at most) fits in {wait:.3f} s", limit,
                              retry_after_s=wait, should_retry=wait <= NO_RETRY_AFTER_S)
        err.extra_headers = d.rate.as_headers()
        return err

    def _log_store_down(self, exc: Exception, tenant: Tenant, action: str) -> None:
        now = time.monotonic()
        if now - self._last_log >= _LOG_EVERY_S:
            self._last_log = now
            log.warning("quota store unreachable (%s): tenant %s: %s; %d store errors so far",
                        exc, tenant.id, action, self.store_errors)

    def _undo_lost(self, tenant: str, request_id: str) -> None:
        """A reserve that timed out may still have run in Redis (slow, not down): settle
        that id at zero, now and once more later, so it holds nothing until its lease
        expires. Settling an id that was never reserved changes nothing."""
        task = asyncio.ensure_future(self._undo(tenant, request_id))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _undo(self, tenant: str, request_id: str) -> None:
        for wait in (0.0, UNDO_AGAIN_S):
            await asyncio.sleep(wait)
            with contextlib.suppress(StoreError):
                if await self.store.settle(tenant, request_id, 0):
                    log.info("undid reservation %s of tenant %s left by a timed-out call",
                             request_id, tenant)
                    return

    # ---- settle ---------------------------------------------------------------------------
    def settle(self, ticket: Ticket, actual_tokens: int) -> None:
        """Settle in a task the Admission owns: it runs even when the caller is cancelled."""
        self.live.pop(ticket.request_id, None)
        task = asyncio.ensure_future(self._settle(ticket, actual_tokens))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(self, ticket: Ticket, actual: int) -> None:
        try:
            await ticket.store.settle(ticket.tenant, ticket.request_id, actual)
        except StoreError as exc:
            # The reservation stays until its lease expires, then counts at its worst case.
            log.warning("settling %s for tenant %s failed (%s); it will expire in %.0f s",
                        ticket.request_id, ticket.tenant, exc, self.lease_ttl_s)

    # ---- renew ----------------------------------------------------------------------------
    async def _renew_loop(self) -> None:
        period = self.lease_ttl_s / 3
        while True:
            await asyncio.sleep(period)
            began = time.perf_counter()
            try:
                await self.renew_leases()
                for hook in self.renew_hooks:
                    await hook()
            except Exception:  # one bad beat must not end the renewals of every lease
                log.exception("a lease renewal beat failed")
            took = time.perf_counter() - began
            self.beats, self.beat_s = self.beats + 1, self.beat_s + took
            self.longest_beat = max(self.longest_beat, took)

    async def renew_leases(self) -> None:
        """One beat: every live lease renewed, one store call per tenant (per
        ``RENEW_BATCH`` leases), all at once: a thousand streams of ten tenants make ten
        round trips, not a thousand queued for the pool ahead of new requests."""
        groups: dict[tuple[int, str], tuple[Store, list[str]]] = {}
        for t in list(self.live.values()):
            groups.setdefault((id(t.store), t.tenant), (t.store, []))[1].append(t.request_id)
        calls = [(store, tenant, ids[i:i + RENEW_BATCH])
                 for (_, tenant), (store, ids) in groups.items()
                 for i in range(0, len(ids), RENEW_BATCH)]
        results = await asyncio.gather(
            *(store.renew_many(tenant, ids, self.lease_ttl_s) for store, tenant, ids in calls),
            return_exceptions=True)
        failed = sum(len(ids) for (_, _, ids), r in zip(calls, results)
                     if isinstance(r, BaseException))
        if failed:
            log.warning("renewing %d of %d leases failed", failed,
                        sum(len(ids) for _, _, ids in calls))
