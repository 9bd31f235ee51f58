"""The upstream call of one generation request, and its answer relayed to the client.

``Relay.call`` makes one attempt on a pool member (``failover`` decides which, and whether
to try another): it posts the prepared body, turns a failure of the server into a
``Fault`` (retryable) and an answer it refuses into the client's ``GatewayError``, stamps
the answer with the versions of the member that made it (checked against the versions the
answer names, re-read when it names others; a pinned request whose member moved to another
revision is a neutral ``Fault``, retried on a member still serving the pin), and relays the
answer: SSE events rewritten one batch at a time (``sse.ChunkRewriter``), or the whole JSON
body. ``Relay.result`` is what happened, frozen, whenever it is asked: settlement, the
ledger, the metrics and the trace read it, also after a failure or a cancellation.

The relay keeps at most one partial SSE event buffered and writes each batch of events as
it arrives; ``send`` waits while the client's socket is full, so a slow reader slows the
upstream read instead of growing memory. Cancellation closes the upstream response
(``http_client`` closes a connection whose response is closed unread), which the bundled
backend sees as a disconnect: it aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from protocol.sse import MAX_EVENT_BYTES, EventSplitter, EventTooLong, dumps
from protocol.versions import RESOLVED_HEADER, SHORT, ResolvedVersions
from telemetry.metrics import Observer

from .client_io import Reply, stamp_headers
from .errors import BadGateway, RevisionMismatch
from .failover import Attempt
from .http_client import Response, UpstreamHTTPError
from .pool import Member
from .resolve import Prepared
from .sse import ChunkRewriter
from .timing import RequestTimes
from .tracing import RELAY
from .upstream import (
    Fault,
    Upstream,
    UpstreamError,
    error_from,
    fault_of,
    header_agrees,
    server_part,
)

MAX_WHOLE_BYTES = 64 * 1024 * 1024  # one non-streamed answer
DRAIN_AFTER_DONE_S = 1.0  # the rest of a stream's body after [DONE], read for keep-alive


@dataclass(slots=True, frozen=True)
class RelayResult:
    """What the upstream did and what reached the client."""

    stamp: ResolvedVersions  # the versions the answer was stamped with
    accepted: bool = False  # the upstream answered 200
    done: bool = False  # [DONE] or the whole answer relayed to the client
    upstream_failed: bool = False  # the upstream sent an error event inside its stream
    usage: Mapping[str, Any] | None = None  # the last usage the upstream reported
    chunks: int = 0  # content chunks relayed
    finish_reason: str | None = None

    def tokens(self, p: Prepared) -> tuple[int, int, bool]:
        """(prompt, completion, exact) tokens to settle: the upstream's usage, else the
        prepared prompt count and the content chunks relayed; nothing if never accepted."""
        if not self.accepted:  # unreachable, refused, cancelled first: nothing ran
            return 0, 0, True
        usage = self.usage or {}
        prompt = _count(usage.get("prompt_tokens"), p.prompt_tokens)
        completion = _count(usage.get("completion_tokens"), self.chunks)
        return prompt, completion, bool(usage) and (p.prompt_exact or "prompt_tokens" in usage)

    @property
    def cached_tokens(self) -> int | None:
        details = (self.usage or {}).get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cached if isinstance(cached, int) else None


class Relay:
    """One request's upstream calls and its answer to the client. ``headers`` go on the
    answer (queue time, rate-limit state); ``refresh`` re-reads an upstream's versions;
    ``itl`` takes the request's inter-token gaps."""

    def __init__(self, p: Prepared, reply: Reply, times: RequestTimes,
                 headers: list[tuple[bytes, bytes]],
                 refresh: Callable[[Upstream], Awaitable[None]],
                 itl: Observer | None = None) -> None:
        self.p = p
        self.reply = reply
        self.times = times
        self.headers = headers
        self.refresh = refresh
        self.itl = itl
        self.stamp = p.stamp
        self.accepted = False
        self.done = False
        self.whole_usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.rewriter: ChunkRewriter | None = None

    def result(self) -> RelayResult:
        rw = self.rewriter
        if rw is None:
            return RelayResult(self.stamp, self.accepted, self.done, usage=self.whole_usage,
                               finish_reason=self.finish_reason)
        return RelayResult(self.stamp, self.accepted, self.done, rw.error, rw.usage,
                           rw.tokens, rw.finish_reason)

    async def call(self, attempt: Attempt) -> None:
        """One attempt on ``attempt.member``; a ``Fault`` when the server failed."""
        p, member = self.p, attempt.member
        up = p.upstream
        headers = [(b"content-type", b"application/json"),
                   (b"x-request-id", p.request_id.encode()), *attempt.headers]
        if member.kind == "sluice":  # our own backend labels its metrics and spans by it
            headers.append((b"x-sluice-tenant", p.tenant.id.encode()))
        try:
            resp = await member.pool.post(p.path, dumps(p.body).encode(), headers)
        except UpstreamHTTPError as exc:
            raise fault_of(exc, up.name, member.url) from None
        attempt.status = resp.status
        if member.versions is not None:  # the member's, not the pool's, from here on
            self._restamp(member.stamp(self.stamp.policy))
        try:
            if resp.status != 200:
                err = await error_from(resp, up.name)
                if resp.status >= 500:
                    raise Fault(f"http_{resp.status}", err, err.retry_after_s
                                if resp.header("retry-after") else None)
                raise err
            self.accepted = True
            await self._check_versions(resp, member)
            if p.stream:
                await self._relay_stream(resp)
            else:
                await self._relay_whole(resp)
        except UpstreamHTTPError as exc:
            raise fault_of(exc, up.name, member.url, answered=True) from None
        finally:
            resp.close()

    async def _check_versions(self, resp: Response, member: Member) -> None:
        """Stamp this answer with the versions of ``member``, the server that made it. A
        bundled backend names its versions on every answer: when they are not the ones last
        read from it (it was upgraded), they are read again first. An answer whose versions
        cannot be confirmed, or that a pinned request must not get, is a neutral ``Fault``:
        failover tries a member that serves the pin, else the client gets the error."""
        up, p = self.p.upstream, self.p
        reported = resp.header(RESOLVED_HEADER) if up.reports(member) else None
        if reported is not None:  # a structured answer names its schema and tools too
            reported = server_part(reported)
        if reported is not None and reported != member.reported_header:
            with contextlib.suppress(UpstreamError):
                await self.refresh(up)
            if member.versions is None or not header_agrees(reported, member.versions):
                raise Fault("versions_unknown", BadGateway(
                    f"the server of the model {up.name!r} answered with versions it does not "
                    f"report ({reported!r})"), neutral=True)
        stamp = member.stamp(self.stamp.policy)
        if stamp is None:  # it named none, and did not answer the last read of them
            raise Fault("versions_unknown", BadGateway(
                f"the versions of the model {up.name!r} are unknown"), neutral=True)
        self._restamp(stamp)
        versions = stamp.versions
        if p.pin is not None and not versions.revision_matches(p.pin):
            raise Fault("revision_moved", RevisionMismatch(
                f"the server of the model {up.name!r} moved to revision "
                f"{versions.revision[:SHORT]!r}, not {p.pin!r}"), neutral=True)

    def _restamp(self, stamp: ResolvedVersions | None) -> None:
        """Stamp the answer (and its trace) with ``stamp`` unless it already says the same."""
        old = self.stamp
        if stamp is not None and (stamp.versions is not old.versions
                                  or stamp.policy != old.policy):
            self.stamp = stamp
            self.reply.trace.stamp(stamp)

    def _answer_headers(self, content_type: bytes) -> list[tuple[bytes, bytes]]:
        p = self.p
        headers = [(b"content-type", content_type), *self.headers,
                   *stamp_headers(self.stamp, p.request_versions)]
        if p.clamped:
            headers.append((b"x-sluice-clamped", p.clamped.encode()))
        if p.degraded:
            headers.append((b"x-sluice-degraded", p.degraded.encode()))
        return headers

    async def _relay_stream(self, resp: Response) -> None:
        p, stamp = self.p, self.stamp
        rewriter = self.rewriter = ChunkRewriter(stamp.model, stamp.fingerprint(),
                                                 p.client_usage, p.client_continuous)
        headers = self._answer_headers(b"text/event-stream; charset=utf-8")
        headers += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        trace = self.reply.trace
        trace.event(RELAY)
        try:
            await self.reply.start(200, headers)
            await self._relay_events(resp, rewriter)
        finally:
            trace.set(chunks=rewriter.chunks)

    async def _relay_events(self, resp: Response, rewriter: ChunkRewriter) -> None:
        send = self.reply.send
        times = self.times
        times.itl = self.itl
        trace = self.reply.trace
        clock = time.monotonic
        split = EventSplitter(MAX_EVENT_BYTES).feed  # LF, CRLF or CR line ends (SSE spec)
        chunks = resp.body_chunks()
        async for raw in chunks:
            try:
                events = split(raw)
            except EventTooLong:
                raise BadGateway("the upstream sent an over-long stream event") from None
            if not events:
                continue
            seen = rewriter.tokens
            out = [chunk for e in events if (chunk := rewriter.rewrite(e)) is not None]
            if out:
                await send({"type": "http.response.body", "body": b"".join(out),
                            "more_body": True})
                if rewriter.tokens > seen:
                    now = clock()
                    if times.chunks(rewriter.tokens - seen, now):
                        trace.first_token(now - times.received)
            if rewriter.done:
                break  # [DONE]: the answer is whole, whatever the upstream does next
        if not rewriter.done:
            raise BadGateway(f"the model {self.p.upstream.name!r} ended its stream early")
        self.done = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        # The connection is reused only once its body has been read to the end, which
        # vLLM and the bundled backend send right after [DONE]; an upstream that holds it
        # open longer has its connection closed instead (the answer is already sent).
        with contextlib.suppress(TimeoutError, UpstreamHTTPError, OSError):
            async with asyncio.timeout(DRAIN_AFTER_DONE_S):
                async for _ in chunks:
                    pass

    async def _relay_whole(self, resp: Response) -> None:
        raw = await resp.read(MAX_WHOLE_BYTES)
        name = self.p.upstream.name
        try:
            obj = json.loads(raw)
            usage = obj.get("usage")
        except (ValueError, AttributeError):
            raise BadGateway(f"the model {name!r} sent a broken answer") from None
        if isinstance(usage, dict):
            self.whole_usage = usage
        choices = obj.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            reason = choices[0].get("finish_reason")
            self.finish_reason = reason if isinstance(reason, str) else None
        obj["model"] = self.stamp.model
        obj["system_fingerprint"] = self.stamp.fingerprint()
        body = dumps(obj).encode()
        headers = self._answer_headers(b"application/json")
        headers.append((b"content-length", str(len(body)).encode()))
        self.reply.trace.event(RELAY)
        await self.reply.start(200, headers)
        await self.reply.send({"type": "http.response.body", "body": body,
                               "more_body": False})
        self.done = True


def _count(value: Any, default: int) -> int:
    return value if isinstance(value, int) and value >= 0 else default
