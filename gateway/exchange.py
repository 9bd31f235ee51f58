"""One generation request, stage by stage; each stage owns its resource:

    resolve    body → ``Prepared`` (frozen)                                 resolve.py
    route      the first pool member (its breaker's pass)                   failover.py
    reserve    ``async with admission.reserve(...)``: the worst case held    admission.py
               in the tenant's budgets, settled at the actual cost on exit
    queue      ``async with queue.slot(...)``: a capacity slot on the        queue.py
               member, given back on exit (a retry trades it for another)
    call       failover over the pool, the answer relayed                   failover.py, relay.py
    → ``Ended``: what the usage ledger, the metrics and the trace read (observe.py)

Any ``GatewayError`` is answered here: a response, or an error event once a stream began.
A client that stalls or leaves ends the request as cancelled; the stages' exits release
everything however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any

from protocol.sse import error_event
from telemetry import priority_class

from .client_io import ClientStalled, Reply, send_error
from .contract import Kind, parse
from .errors import GatewayError, GatewayTimeout, InternalError
from .failover import Failover
from .outcome import Ended, conclude
from .pool import Member
from .queue import DispatchQueue, Slot, SlotRequest
from .relay import Relay, RelayResult
from .resolve import Prepared, Target
from .service import Gateway
from .tenants import Tenant
from .timing import RequestTimes
from .tracing import NoTrace, describe

log = logging.getLogger("sluice.gateway.exchange")


class Exchange:
    """Runs one request's stages; ``ended`` is set once it has ended, however it ended."""

    def __init__(self, gw: Gateway, kind: Kind, tenant: Tenant, reply: Reply,
                 times: RequestTimes) -> None:
        self.gw = gw
        self.kind = kind
        self.tenant = tenant
        self.reply = reply
        self.trace: NoTrace = reply.trace
        self.times = times
        self.attempt_id = uuid.uuid4().hex
        self.ended: Ended | None = None
        # the stages' results, for ``ended``
        self._prepared: Prepared | None = None
        self._reserved = False
        self._queued_s: float | None = None
        self._relay: Relay | None = None
        self._result: RelayResult | None = None  # built once, when the reservation settles

    async def run(self, body: dict[str, Any], header_deadline_ms: int | None) -> None:
        cancelled = False
        try:
            p = self._prepared = await self._prepare(body, header_deadline_ms)
            if p is not None:
                await self._serve(p)
        except ClientStalled:
            cancelled = True
            self.gw.metrics.client_stalls += 1
            log.info("request %s: the client read nothing for %.1f s; cancelled",
                     self.reply.request_id, self.gw.config.timeouts.client_stall_s)
        except asyncio.CancelledError:
            cancelled = True
            raise
        except Exception as exc:  # a bug: logged, answered 500 in OpenAI's shape
            log.exception("unhandled error (request id %s)", self.reply.request_id,
                          exc_info=exc)
            await self._internal_error(exc)
        finally:
            self.ended = self._conclude(cancelled)

    def _conclude(self, cancelled: bool) -> Ended:
        """The request's record; the usage ledger settles it if it held a reservation."""
        ended = conclude(self.reply.status, self.reply.error, cancelled, self._prepared,
                         self._reserved, self._queued_s, self._result)
        self.gw.ledger.settle_ended(self.attempt_id, ended)
        return ended

    async def _internal_error(self, exc: Exception) -> None:
        if not self.reply.started:
            with contextlib.suppress(ClientStalled):
                await send_error(self.reply, InternalError(
                    f"internal error ({type(exc).__name__}); request id "
                    f"{self.reply.request_id}"), None)

    async def _prepare(self, body: dict[str, Any], deadline_ms: int | None) -> Prepared | None:
        """The resolve stage; answers its error (stamped once the target is known)."""
        resolver, trace = self.gw.resolver, self.trace
        target: Target | None = None
        try:
            req = parse(self.kind, body)
            target = await resolver.target(req, self.tenant)
            p = await resolver.prepare(self.kind, req, body, target, self.tenant,
                                       self.reply.request_id, deadline_ms)
        except GatewayError as err:
            stamp = target.stamp if target is not None else None
            if stamp is not None:
                trace.stamp(stamp)
            await send_error(self.reply, err, stamp)
            return None
        if trace.recording:
            describe(trace, p)
        return p

    async def _serve(self, p: Prepared) -> None:
        """Route, reserve, queue, call; every ``GatewayError`` is answered here."""
        gw = self.gw
        failover = Failover(p.upstream.name, p.upstream.router, gw.retry_budget, gw.metrics,
                            self.trace, p.worst_case, p.prefix_key, p.path, p.pin)
        try:
            first = failover.first()
            await self._admit_and_call(p, failover, gw.queues[first.member.key])
        except GatewayError as err:
            if self.reply.started:
                self.reply.failed(err)
                await self.reply.send({"type": "http.response.body", "body": error_event(err),
                                       "more_body": False})
            else:
                stamp = self._relay.stamp if self._relay is not None else p.stamp
                await send_error(self.reply, err, stamp, p.request_versions)
        finally:
            failover.close()

    async def _admit_and_call(self, p: Prepared, failover: Failover,
                              queue: DispatchQueue) -> None:
        gw, tenant, trace = self.gw, self.tenant, self.trace
        req = SlotRequest(self.attempt_id, tenant.id, tenant.weight, p.priority, p.worst_case,
                          p.deadline, tenant.max_queued, tenant.fail_mode == "open")
        reservation = gw.admission.reserve(tenant, self.attempt_id, p.worst_case, trace,
                                           p.worst_terms)
        # With nobody waiting, ask the capacity gate for a slot while the quota store
        # reserves: one round trip before dispatch instead of two. Given back if unused.
        async with queue.early(req) as early, reservation as ticket:
            self._reserved = True
            try:
                async with queue.slot(req, early, trace) as slot:
                    self._queued_s = slot.waited_s
                    await self._call(p, failover, req, slot, [
                        (b"x-sluice-queue-ms", str(int(slot.waited_s * 1000)).encode()),
                        *ticket.decision.rate.as_headers()])
            finally:
                result = self._result = self._relay.result() if self._relay else None
                if result is not None:
                    reservation.settle_at(*result.tokens(p)[:2])

    async def _call(self, p: Prepared, failover: Failover, req: SlotRequest, slot: Slot,
                    headers: list[tuple[bytes, bytes]]) -> None:
        """Failover over the pool, the answer relayed; a retry holds its own slot."""
        gw = self.gw
        relay = self._relay = Relay(p, self.reply, self.times, headers, gw.refresh,
                                    gw.metrics.itl.child(self.tenant.id, p.upstream.name,
                                                         priority_class(p.priority)))
        held = [slot]

        async def take(member: Member) -> None:
            held.append(await gw.queues[member.key].take(req))

        try:
            async with asyncio.timeout_at(p.deadline):
                await failover.run(relay.call, lambda: self.reply.started,
                                   lambda: held[-1].release(), take)
        except TimeoutError:
            raise self._deadline_error(p) from None
        finally:
            for s in held[1:]:  # the first is the caller's: released on its exit
                s.release()

    def _deadline_error(self, p: Prepared) -> GatewayTimeout:
        if p.total_timeout:
            return GatewayTimeout(f"the answer took longer than the gateway's total timeout "
                                  f"({self.gw.config.timeouts.total_s} s)", code="total_timeout")
        return GatewayTimeout("the request's deadline passed before the model finished",
                              code="deadline_exceeded")
