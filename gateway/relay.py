"""One generation request's work: prepare, reserve, queue, call the pool, relay, settle.

``endpoint.ProxyEndpoint`` runs an ``Exchange`` as a task it cancels when the client leaves;
cancellation closes the upstream response (``http_client`` closes the connection when a
response is closed unread), which the bundled backend sees as a disconnect and aborts the
request in the engine. Settlement runs in ``finally``, so it happens however the request
ends. Which pool member is called, and the retries on another, are ``failover``'s.

The relay keeps at most one partial SSE event buffered and writes each batch of events as it
arrives; ``send`` waits while the client's socket is full, so a slow reader slows the
upstream read instead of growing memory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from policies.breaker import Outcome
from telemetry import priority_class

from .admission import Ticket
from .client_io import (
    ClientStalled,
    Reply,
    error_event,
    send_error,
    stamp_headers,
)
from .errors import (
    BadGateway,
    GatewayError,
    GatewayTimeout,
    RevisionMismatch,
)
from .failover import Attempt, Fault, call_with_failover, first_attempt
from .http_client import Response, UpstreamHTTPError
from .metrics import RequestTimes
from .pool import Member
from .queue import DispatchQueue
from .service import Gateway, Prepared
from .sse import ChunkRewriter, dumps
from .stamp import Stamp
from .tenants import Tenant
from .tracing import (
    QUEUE,
    RELAY,
    RESERVE,
    SETTLE,
    UPSTREAM,
    reject_reason,
)
from .upstream import RESOLVED_HEADER, UpstreamError, error_from, fault_of
from .usage import Settlement

log = logging.getLogger("sluice.gateway.relay")

MAX_EVENT_BYTES = 4 * 1024 * 1024  # one SSE event from the upstream; more is a broken stream
MAX_WHOLE_BYTES = 64 * 1024 * 1024  # one non-streamed answer


class Exchange:
    """One generation request from preparation to settlement."""

    def __init__(self, gw: Gateway, kind: str, tenant: Tenant, reply: Reply,
                 times: RequestTimes) -> None:
        self.gw = gw
        self.times = times
        self.trace = reply.trace
        self.kind = kind
        self.tenant = tenant
        self.request_id = reply.request_id
        # The client's x-request-id may repeat (a retry, a careless client); reservations,
        # slots and settlement are keyed by this attempt's own id, never double-charged.
        self.attempt_id = uuid.uuid4().hex
        self.reply = reply
        self.send = reply.send
        self.p: Prepared | None = None
        self.stamps: list[Stamp] = []
        self.accepted = False  # the upstream answered 200
        self.client_gone = False
        self.done = False  # [DONE] or a whole answer relayed
        self.outcome = "ok"
        self.usage: dict[str, Any] | None = None  # usage of a whole answer
        self.rewriter: ChunkRewriter | None = None  # a stream's: last usage, chunks relayed
        self.ticket: Ticket | None = None  # the granted reservation
        self.slot: DispatchQueue | None = None  # the queue whose capacity slot it holds
        self.attempt: Attempt | None = None  # the pool member being tried
        self.prefix_key: bytes | None = None  # what prefix-affine routing hashes
        self.queue_ms = 0
        self.upstream_status = 0
        self.queued_s: float | None = None  # time in the gateway's queue, once dispatched
        self.finish_reason: str | None = None  # of a whole answer
        self.prompt_tokens = 0  # as settled
        self.completion_tokens = 0

    async def run(self, body: dict[str, Any], header_deadline_ms: int | None) -> None:
        try:
            self.p = await self.gw.prepare(self.kind, body, self.tenant,  # type: ignore[arg-type]
                                           self.request_id, header_deadline_ms, self.stamps)
        except GatewayError as err:
            if self.stamps:
                self.trace.stamp(self.stamps[0])
            await send_error(self.reply, err, self.stamps[0] if self.stamps else None)
            return
        trace = self.trace
        if trace.recording:
            self._describe(self.p)
        body = self.p.body
        self.prefix_key = self.p.upstream.router.prefix_key(
            self.tenant.id, body.get("messages", body.get("prompt")))
        try:
            self.attempt = first_attempt(self)
        except GatewayError as err:
            await send_error(self.reply, err, self.p.stamp)
            return
        try:
            await self._admit_and_call(self.gw.queues[self.attempt.member.key])
        finally:
            if self.attempt is not None:
                self.attempt.done("neutral")  # never called (refused, cancelled): no verdict

    async def _admit_and_call(self, queue: DispatchQueue) -> None:
        assert self.p is not None
        trace = self.trace
        fail_open = self.tenant.fail_mode == "open"
        # With nobody waiting, ask the capacity gate for a slot while the quota store
        # reserves: one round trip before dispatch instead of two. Given back if refused.
        early = queue.try_early(self.attempt_id, self.p.worst_case, fail_open, self.p.priority)
        span = trace.start(RESERVE, {"sluice.reserved_tokens": self.p.worst_case})
        try:
            self.ticket = await self._reserve(self.p)
        except GatewayError as err:
            trace.end(span, **{"sluice.granted": False, "error.type": reject_reason(err)})
            queue.drop_early(self.attempt_id, early)
            await send_error(self.reply, err, self.p.stamp)
            return
        except BaseException:
            trace.end(span, **{"sluice.granted": False})
            queue.drop_early(self.attempt_id, early)
            raise
        trace.end(span, **{"sluice.granted": True, "sluice.fail_open": self.ticket.local})
        try:
            span = trace.start(QUEUE, {"sluice.queue.length": queue.size})
            try:
                if early is not None and await queue.took_early(early):
                    waited = 0.0
                else:
                    waited = await queue.acquire(
                        self.attempt_id, self.tenant.id, self.tenant.weight,
                        self.p.priority, self.p.worst_case, self.p.deadline,
                        self.tenant.max_queued, fail_open=fail_open)
            except GatewayError as err:
                trace.end(span, **{"error.type": reject_reason(err)})
                self.outcome = "shed"
                raise
            except BaseException:
                trace.end(span)
                queue.drop_early(self.attempt_id, early)
                raise
            self.queue_ms = int(waited * 1000)
            self.queued_s = waited
            trace.end(span, **{"sluice.queue_ms": self.queue_ms})
            trace.set(queue_ms=self.queue_ms)
            self.slot = queue
            try:
                async with asyncio.timeout_at(self.p.deadline):
                    await call_with_failover(self)
            except TimeoutError:
                raise self._deadline_error() from None
        except ClientStalled:
            self.outcome = "cancelled"
            self.client_gone = True
            self.gw.metrics.client_stalls += 1
            log.info("request %s: the client read nothing for %.1f s; cancelled",
                     self.request_id, self.gw.config.timeouts.client_stall_s)
        except GatewayError as err:
            if self.outcome != "shed":
                self.outcome = "timeout" if isinstance(err, GatewayTimeout) \
                    else "upstream_error"
                if isinstance(err, RevisionMismatch) or err.status < 500:
                    self.outcome = "refused"
            if self.reply.started:
                self.reply.failed(err)
                await self.send({"type": "http.response.body", "body": error_event(err),
                                 "more_body": False})
            else:
                await send_error(self.reply, err, self.p.stamp)
        except asyncio.CancelledError:
            self.outcome = "cancelled"
            raise
        finally:
            self.release_slot()
            span = trace.start(SETTLE)
            self._settle(self.p)
            trace.end(span, **{"gen_ai.usage.input_tokens": self.prompt_tokens,
                               "gen_ai.usage.output_tokens": self.completion_tokens})

    def _describe(self, p: Prepared) -> None:
        """The request's attributes on its root span (GenAI names where they exist)."""
        body = p.body
        self.trace.set(priority=p.priority, model=p.upstream.name + (f"@{p.pin}" if p.pin else ""),
                       max_tokens=p.max_tokens, temperature=body.get("temperature"),
                       top_p=body.get("top_p"), stream=p.stream, worst_case=p.worst_case)
        self.trace.stamp(p.stamp)
        if p.degraded:
            self.trace.set(**{"sluice.degraded": p.degraded})

    async def _reserve(self, p: Prepared) -> Ticket:
        """Reserve the worst case. The store call is shielded: a client leaving mid-call
        must not leave a granted reservation behind, so it is settled at zero instead."""
        adm = self.gw.admission
        call = asyncio.ensure_future(adm.reserve(self.tenant, self.attempt_id, p.worst_case))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            def undo(done: asyncio.Future[Ticket]) -> None:
                if not done.cancelled() and done.exception() is None:
                    adm.settle(done.result(), 0)

            call.add_done_callback(undo)
            raise

    # ---- capacity slots (a retry trades its slot for one on the next member) --------------
    async def take_slot(self, queue: DispatchQueue) -> None:
        assert self.p is not None
        p = self.p
        await queue.acquire(self.attempt_id, self.tenant.id, self.tenant.weight, p.priority,
                            p.worst_case, p.deadline, self.tenant.max_queued,
                            fail_open=self.tenant.fail_mode == "open")
        self.slot = queue

    def release_slot(self) -> None:
        if self.slot is not None and self.p is not None:
            self.slot.release(self.attempt_id, self.p.worst_case)
        self.slot = None

    def _deadline_error(self) -> GatewayTimeout:
        p = self.p
        if p is not None and p.total_timeout:
            return GatewayTimeout(f"the answer took longer than the gateway's total timeout "
                                  f"({self.gw.config.timeouts.total_s} s)", code="total_timeout")
        return GatewayTimeout("the request's deadline passed before the model finished",
                              code="deadline_exceeded")

    # ---- the upstream call ----------------------------------------------------------------
    async def call_member(self, member: Member) -> None:
        """One attempt on ``member``; a ``Fault`` when the server failed (see failover)."""
        p = self.p
        assert p is not None and self.attempt is not None
        path = "/v1/chat/completions" if p.kind == "chat" else "/v1/completions"
        trace = self.trace
        span = trace.start(UPSTREAM, {
            "server.address": p.upstream.name, "url.path": path,
            "sluice.upstream.member": member.url, "sluice.attempt": self.attempt.number,
            "sluice.breaker.state": member.breaker.state,
            "sluice.breaker.probe": self.attempt.grant.probe}) if trace.recording else None
        headers = [(b"content-type", b"application/json"),
                   (b"x-request-id", p.request_id.encode())] + trace.upstream_headers(span)
        if member.kind == "sluice":  # our own backend labels its metrics and spans by it
            headers.append((b"x-sluice-tenant", self.tenant.id.encode()))
        self.upstream_status = 0
        failed: str | None = None
        verdict: Outcome = "neutral"  # a 4xx, the client gone: says nothing of the server
        try:
            await self._exchange_upstream(p, member, path, headers)
            verdict = "success"
        except Fault as fault:
            failed, verdict = fault.reason, "failure"
            raise
        except GatewayError as err:
            failed = err.code or type(err).__name__
            raise
        finally:
            if span is None:  # not traced
                self.attempt.done(verdict)
            else:
                before = member.breaker.state
                self.attempt.done(verdict)  # judged here: a transition is on this span
                attrs: dict[str, Any] = {"http.response.status_code": self.upstream_status}
                if failed is not None:
                    attrs["error.type"] = failed
                after = member.breaker.state
                if after != before:
                    attrs["sluice.breaker.transition"] = f"{before}->{after}"
                trace.end(span, **attrs)

    async def _exchange_upstream(self, p: Prepared, member: Member, path: str,
                                 headers: list[tuple[bytes, bytes]]) -> None:
        up = p.upstream
        try:
            resp = await member.pool.post(path, dumps(p.body).encode(), headers)
        except UpstreamHTTPError as exc:
            raise fault_of(exc, up.name, member.url) from None
        self.upstream_status = resp.status
        try:
            if resp.status != 200:
                err = await error_from(resp, up.name)
                if resp.status >= 500:
                    raise Fault(f"http_{resp.status}", err, err.retry_after_s
                                if resp.header("retry-after") else None)
                raise err
            self.accepted = True
            await self._check_versions(p, resp)
            if p.stream:
                await self._relay_stream(p, resp)
            else:
                await self._relay_whole(p, resp)
        except UpstreamHTTPError as exc:
            raise fault_of(exc, up.name, member.url, answered=True) from None
        finally:
            resp.close()

    async def _check_versions(self, p: Prepared, resp: Response) -> None:
        """The bundled backend names its versions on every answer; if they moved since the
        last refresh, re-read them so that this answer's stamp is the truth."""
        up = p.upstream
        reported = resp.header(RESOLVED_HEADER)
        if reported is None or up.reported_header is None or reported == up.reported_header:
            return
        try:
            await self.gw.refresh(up)
        except UpstreamError:
            return
        versions = up.versions
        if versions is None or versions == p.stamp.versions:
            return
        if p.pin is not None and not versions.revision_matches(p.pin):
            raise RevisionMismatch(f"the model {up.name!r} changed to revision "
                                   f"{versions.revision[:12]!r}, not {p.pin!r}")
        p.stamp = Stamp(p.stamp.model, versions, p.stamp.policy)

    def _headers(self, p: Prepared, content_type: bytes) -> list[tuple[bytes, bytes]]:
        headers = [(b"content-type", content_type), (b"x-sluice-queue-ms",
                                                     str(self.queue_ms).encode())]
        headers += stamp_headers(p.stamp)
        if self.ticket is not None:
            headers += self.ticket.decision.rate.as_headers()
        if p.clamped:
            headers.append((b"x-sluice-clamped", p.clamped.encode()))
        if p.degraded:
            headers.append((b"x-sluice-degraded", p.degraded.encode()))
        return headers

    async def _relay_stream(self, p: Prepared, resp: Response) -> None:
        rewriter = self.rewriter = ChunkRewriter(p.stamp.model, p.stamp.fingerprint(),
                                                 p.client_usage, p.client_continuous)
        headers = self._headers(p, b"text/event-stream; charset=utf-8")
        headers += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        trace = self.trace
        span = trace.start(RELAY)
        try:
            await self.reply.start(200, headers)
            await self._relay_events(p, resp, rewriter)
        finally:
            trace.end(span, **{"sluice.chunks": rewriter.chunks})

    async def _relay_events(self, p: Prepared, resp: Response, rewriter: ChunkRewriter) -> None:
        send = self.send
        times = self.times
        times.itl = self.gw.metrics.itl.child(self.tenant.id, p.upstream.name,
                                              priority_class(p.priority))
        clock = time.monotonic
        buf = b""
        async for raw in resp.body_chunks():
            buf = buf + raw if buf else raw
            end = buf.rfind(b"\n\n")
            if end < 0:
                if len(buf) > MAX_EVENT_BYTES:
                    raise BadGateway("the upstream sent an over-long stream event")
                continue
            events = buf[:end].split(b"\n\n")
            buf = buf[end + 2:]
            seen = rewriter.tokens
            out = [chunk for e in events if (chunk := rewriter.rewrite(e)) is not None]
            if out:
                await send({"type": "http.response.body", "body": b"".join(out),
                            "more_body": True})
                if rewriter.tokens > seen:
                    now = clock()
                    if times.chunks(rewriter.tokens - seen, now):
                        self.trace.first_token(now - times.received)
        if rewriter.error:
            self.outcome = "upstream_error"
        if not rewriter.done:
            raise BadGateway(f"the model {p.upstream.name!r} ended its stream early")
        self.done = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _relay_whole(self, p: Prepared, resp: Response) -> None:
        raw = await resp.read(MAX_WHOLE_BYTES)
        try:
            obj = json.loads(raw)
            usage = obj.get("usage")
        except (ValueError, AttributeError):
            raise BadGateway(f"the model {p.upstream.name!r} sent a broken answer") from None
        if isinstance(usage, dict):
            self.usage = usage
        choices = obj.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            self.finish_reason = choices[0].get("finish_reason")
        obj["model"] = p.stamp.model
        obj["system_fingerprint"] = p.stamp.fingerprint()
        body = dumps(obj).encode()
        headers = self._headers(p, b"application/json")
        headers.append((b"content-length", str(len(body)).encode()))
        span = self.trace.start(RELAY)
        try:
            await self.reply.start(200, headers)
            await self.send({"type": "http.response.body", "body": body, "more_body": False})
        finally:
            self.trace.end(span)
        self.done = True

    # ---- settlement -----------------------------------------------------------------------
    def _settle(self, p: Prepared) -> None:
        usage = self.usage or {}
        chunks = 0
        if self.rewriter is not None:
            usage = self.rewriter.usage or {}
            chunks = self.rewriter.tokens
        if not self.accepted:
            # The upstream never took the request (unreachable, refused, cancelled first).
            prompt = completion = 0
            exact = True
        else:
            prompt = _int(usage.get("prompt_tokens"), p.prompt_tokens)
            completion = _int(usage.get("completion_tokens"), chunks)
            exact = bool(usage) and (p.prompt_exact or "prompt_tokens" in usage)
        if self.client_gone and not self.done:
            self.outcome = "cancelled"
        self.prompt_tokens, self.completion_tokens = prompt, completion
        if self.trace.recording:
            details = usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            reason = self.rewriter.finish_reason if self.rewriter is not None \
                else self.finish_reason
            self.trace.set(input_tokens=prompt, output_tokens=completion,
                           cached_tokens=cached if isinstance(cached, int) else None,
                           finish_reason=(reason,) if isinstance(reason, str) else None)
        if self.ticket is not None:
            self.gw.admission.settle(self.ticket, prompt + completion)
        self.gw.ledger.settle(Settlement(
            request_id=self.attempt_id, tenant=self.tenant.id, model=p.upstream.name,
            prompt_tokens=prompt, completion_tokens=completion, outcome=self.outcome,
            exact=exact))


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and value >= 0 else default
