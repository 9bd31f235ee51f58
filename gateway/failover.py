"""Attempts on a model's pool: route, call, judge the upstream, retry on another server.

One request makes at most ``retry.max_attempts`` attempts, each on a different member. A
failed attempt is retried only when all of these hold:
* it failed in a way that says the *server* is unwell (``Fault``): connect refused or timed
  out, a 5xx, no answer within ``first_byte_s``, the connection broken before the answer;
  never a 4xx, never a client that left;
* no byte has reached the client yet (a streamed answer is never replayed);
* another member can take it (breaker closed or probing, no Retry-After pending);
* the retry budget has a retry to spend (``policies.retry_budget``: ≤ 10 % extra load).
The retry waits a fully jittered backoff, gives its capacity slot back on the failed member
and takes one on the next (its quota reservation stays: the request is charged once, at
settlement). An upstream's Retry-After keeps its member out of routing until then.

Every attempt records its outcome on the member's breaker exactly once (``Attempt.done``,
called by ``Exchange.call_member``) and is its own ``sluice.upstream`` phase on the trace,
with the member, the attempt number, the breaker state (and the transition the outcome
caused) and, when it failed, ``error.type`` (the fault, e.g. a timeout's kind); the wait
before a retry is a ``sluice.retry.backoff`` phase.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from policies.breaker import Outcome, Pass

from .errors import GatewayError, GatewayTimeout, ServiceUnavailable
from .pool import AllOpen, Member

if TYPE_CHECKING:
    from .relay import Exchange


class CircuitOpen(ServiceUnavailable):
    code = "upstream_circuit_open"


class Fault(Exception):
    """An attempt failed because of the server; ``err`` is what the client would get."""

    def __init__(self, reason: str, err: GatewayError,
                 retry_after_s: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.err = err
        self.retry_after_s = retry_after_s


@dataclass(slots=True, eq=False)
class Attempt:
    member: Member
    grant: Pass
    number: int
    tokens: int
    recorded: bool = False

    def begin(self) -> None:
        self.member.inflight_tokens += self.tokens
        self.member.inflight_requests += 1

    def done(self, outcome: Outcome) -> None:
        """Judge the server once; frees a half-open probe place and the load it carried."""
        if self.recorded:
            return
        self.recorded = True
        self.member.inflight_tokens -= self.tokens
        self.member.inflight_requests -= 1
        self.member.breaker.record(self.grant, outcome)


def first_attempt(ex: Exchange) -> Attempt:
    """Route a new request; ``CircuitOpen`` (503, Retry-After) when no member can take it."""
    p = ex.p
    assert p is not None
    up = p.upstream
    try:
        member, grant = up.router.pick(p.worst_case, ex.prefix_key)
    except AllOpen as exc:
        ex.gw.metrics.count_retry(up.name, "all_open")
        raise CircuitOpen(f"every server of the model {up.name!r} is failing; the next "
                          f"probe is due in {exc.retry_after_s:.3f} s",
                          retry_after_s=exc.retry_after_s) from None
    attempt = Attempt(member, grant, 1, p.worst_case)
    attempt.begin()
    return attempt


async def call_with_failover(ex: Exchange) -> None:
    """Call ``ex.attempt``'s member, retrying elsewhere while the rules above allow."""
    p = ex.p
    assert p is not None and ex.attempt is not None
    gw = ex.gw
    budget = gw.retry_budget
    budget.on_request()
    tried = {ex.attempt.member.key}
    while True:
        attempt = ex.attempt
        try:
            await ex.call_member(attempt.member)  # judges the member on its breaker
        except Fault as fault:
            gw.metrics.count_failure(attempt.member, fault.reason)
            if fault.retry_after_s:
                m = attempt.member
                m.not_before = max(m.not_before, m.clock() + fault.retry_after_s)
            nxt = _next(ex, fault, tried)
            if nxt is None:
                raise fault.err from None
            tried.add(nxt.member.key)
            await _move_to(ex, nxt, budget.backoff(nxt.number - 1))
            continue
        return


def _next(ex: Exchange, fault: Fault, tried: set[str]) -> Attempt | None:
    """The next attempt, or None when this failure goes to the client."""
    p = ex.p
    assert p is not None and ex.attempt is not None
    metrics = ex.gw.metrics
    model = p.upstream.name
    if ex.reply.started:
        return None
    budget = ex.gw.retry_budget
    if ex.attempt.number >= budget.policy.max_attempts:
        metrics.count_retry(model, "attempts_exhausted")
        return None
    try:
        member, grant = p.upstream.router.pick(p.worst_case, ex.prefix_key, frozenset(tried))
    except AllOpen:
        metrics.count_retry(model, "no_other_upstream")
        return None
    if not budget.try_retry():
        member.breaker.record(grant, "neutral")
        metrics.count_retry(model, "budget_exhausted")
        return None
    metrics.count_retry(model, "retried")
    return Attempt(member, grant, ex.attempt.number + 1, p.worst_case)


async def _move_to(ex: Exchange, nxt: Attempt, backoff_s: float) -> None:
    """Back off, then trade the capacity slot on the failed member for one on ``nxt``."""
    p = ex.p
    assert p is not None
    nxt.begin()
    ex.attempt = nxt
    ex.release_slot()
    try:
        span = ex.trace.start("sluice.retry.backoff", {"sluice.attempt": nxt.number,
                                                       "sluice.upstream.member": nxt.member.url})
        try:
            await asyncio.sleep(backoff_s)
        finally:
            ex.trace.end(span, **{"sluice.backoff_ms": round(backoff_s * 1000, 3)})
        await ex.take_slot(ex.gw.queues[nxt.member.key])
    except TimeoutError:
        nxt.done("neutral")
        raise GatewayTimeout("the request's deadline passed while retrying",
                             code="deadline_exceeded") from None
    except BaseException:
        nxt.done("neutral")
        raise
