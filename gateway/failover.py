"""Attempts on a model's pool: route, call, judge the upstream, retry on another server.

One request makes at most ``retry.max_attempts`` attempts, each on a different member. A
failed attempt is retried only when all of these hold:
* it failed in a way that says the *server* is unwell (``upstream.Fault``): connect refused
  or timed out, a 5xx, no answer within ``first_byte_s``, the connection broken before the
  answer; never a 4xx, never a client that left;
* no byte has reached the client yet (a streamed answer is never replayed);
* another member can take it (breaker closed or probing, no Retry-After pending) and, for a
  pinned request, is known to serve the pinned revision;
* the retry budget has a retry to spend (``policies.retry_budget``: ≤ 10 % extra load).
The retry gives its capacity slot on the failed member back at once (the caller's
``release``), waits a fully jittered backoff, then takes a slot on the next member (``take``);
its quota reservation stays: the request is charged once, at settlement. An upstream's Retry-After keeps its member out of routing
until then.

A pinned request is routed only among the members serving its revision (``Router.pick``);
when none does it is refused with 503 ``revision_unavailable``. A member whose revision
moved under an attempt (``Fault.neutral``) is retried elsewhere like a failure, but its
breaker hears nothing against it.

Every attempt records its outcome on the member's breaker exactly once (``Attempt.done``)
and is its own ``sluice.upstream`` phase on the trace, with the member, the attempt number,
the breaker state (and the transition the outcome caused), the upstream's status and, when
it failed, ``error.type`` (the fault, e.g. a timeout's kind); the wait before a retry is a
``sluice.retry.backoff`` phase.

``Failover`` knows nothing of the relay: it calls narrow callables (``call`` an attempt,
``started`` whether the client has bytes, ``release`` and ``take`` the capacity slot), so it
is tested alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from policies.breaker import Outcome as Verdict
from policies.breaker import Pass
from policies.retry_budget import RetryBudget

from .errors import GatewayError, GatewayTimeout, RevisionUnavailable, ServiceUnavailable
from .pool import AllOpen, Member, NoRevision, Router
from .tracing import BACKOFF, UPSTREAM, NoTrace
from .upstream import Fault

T = TypeVar("T")
Headers = list[tuple[bytes, bytes]]


class CircuitOpen(ServiceUnavailable):
    code = "upstream_circuit_open"


@dataclass(slots=True, eq=False)
class Attempt:
    """One try on one member. ``headers`` (the trace context for the upstream) is set
    before the call; ``status`` is the upstream's HTTP status, which the call sets once the
    upstream answers (the attempt's span reports it)."""

    member: Member
    grant: Pass
    number: int
    tokens: int
    headers: Headers = field(default_factory=list)
    status: int = 0
    recorded: bool = False

    def begin(self) -> None:
        self.member.inflight_tokens += self.tokens
        self.member.inflight_requests += 1

    def done(self, verdict: Verdict) -> None:
        """Judge the server once; frees a half-open probe place and the load it carried."""
        if self.recorded:
            return
        self.recorded = True
        self.member.inflight_tokens -= self.tokens
        self.member.inflight_requests -= 1
        self.member.breaker.record(self.grant, verdict)


class RetryCounter(Protocol):
    """Where failover counts its decisions (the gateway's metrics)."""

    def count_retry(self, model: str, outcome: str) -> None: ...
    def count_failure(self, member: Member, reason: str) -> None: ...


class Failover:
    """The attempts of one request on ``model``'s pool."""

    def __init__(self, model: str, router: Router, budget: RetryBudget,
                 counter: RetryCounter, trace: NoTrace, tokens: int,
                 prefix_key: bytes | None = None, path: str = "/v1/chat/completions",
                 pin: str | None = None) -> None:
        self.model = model
        self.pin = pin  # the revision the client pinned: only members serving it are tried
        self.path = path
        self.router = router
        self.budget = budget
        self.counter = counter
        self.trace = trace
        self.tokens = tokens
        self.prefix_key = prefix_key
        self.attempt: Attempt | None = None  # the one being tried
        self._tried: set[str] = set()  # members tried, by key

    def first(self) -> Attempt:
        """Route a new request; ``CircuitOpen`` (503, Retry-After) when no member can."""
        try:
            member, grant = self.router.pick(self.tokens, self.prefix_key, pin=self.pin)
        except NoRevision as exc:  # the pin's last member moved since the resolve stage
            raise RevisionUnavailable(f"no server of the model {self.model!r} serves revision "
                                      f"{self.pin!r} now", "model",
                                      retry_after_s=exc.retry_after_s) from None
        except AllOpen as exc:
            self.counter.count_retry(self.model, "all_open")
            raise CircuitOpen(f"every server of the model {self.model!r} is failing; the "
                              f"next probe is due in {exc.retry_after_s:.3f} s",
                              retry_after_s=exc.retry_after_s) from None
        self.attempt = Attempt(member, grant, 1, self.tokens)
        self.attempt.begin()
        self._tried.add(member.key)
        return self.attempt

    def close(self) -> None:
        """An attempt never called (refused, cancelled first) gives no verdict."""
        if self.attempt is not None:
            self.attempt.done("neutral")

    async def run(self, call: Callable[[Attempt], Awaitable[T]], started: Callable[[], bool],
                  release: Callable[[], None], take: Callable[[Member], Awaitable[None]]) -> T:
        """Call the first attempt's member, retrying elsewhere while the rules allow."""
        if self.attempt is None:
            raise RuntimeError("Failover.run before Failover.first")
        self.budget.on_request()
        while True:
            attempt = self.attempt
            try:
                return await self._call(attempt, call)
            except Fault as fault:
                if not fault.neutral:
                    self.counter.count_failure(attempt.member, fault.reason)
                if fault.retry_after_s:
                    m = attempt.member
                    m.not_before = max(m.not_before, m.clock() + fault.retry_after_s)
                nxt = None if started() else self._next(attempt)
                if nxt is None:
                    raise fault.err from None
                release()  # nothing runs there any more: the slot is free at once
                await self._move_to(nxt, take, self.budget.backoff(nxt.number - 1))

    async def _call(self, attempt: Attempt, call: Callable[[Attempt], Awaitable[T]]) -> T:
        """One attempt, judged on the member's breaker and traced as one phase."""
        member = attempt.member
        trace = self.trace
        span = trace.start(UPSTREAM, {
            "server.address": self.model, "url.path": self.path,
            "sluice.upstream.member": member.url,
            "sluice.attempt": attempt.number, "sluice.breaker.state": member.breaker.state,
            "sluice.breaker.probe": attempt.grant.probe}) if trace.recording else None
        attempt.headers = trace.upstream_headers(span)
        failed: str | None = None
        verdict: Verdict = "neutral"  # a 4xx, the client gone: says nothing of the server
        try:
            result = await call(attempt)
            verdict = "success"
            return result
        except Fault as fault:
            failed, verdict = fault.reason, "neutral" if fault.neutral else "failure"
            raise
        except GatewayError as err:
            failed = err.code or type(err).__name__
            raise
        finally:
            if span is None:  # not traced
                attempt.done(verdict)
            else:
                before = member.breaker.state
                attempt.done(verdict)  # judged here: a transition is on this span
                attrs: dict[str, Any] = {"http.response.status_code": attempt.status}
                if failed is not None:
                    attrs["error.type"] = failed
                after = member.breaker.state
                if after != before:
                    attrs["sluice.breaker.transition"] = f"{before}->{after}"
                trace.end(span, **attrs)

    def _next(self, failed: Attempt) -> Attempt | None:
        """The next attempt, or None when this failure goes to the client."""
        if failed.number >= self.budget.policy.max_attempts:
            self.counter.count_retry(self.model, "attempts_exhausted")
            return None
        try:
            member, grant = self.router.pick(self.tokens, self.prefix_key,
                                             frozenset(self._tried), self.pin)
        except AllOpen:
            self.counter.count_retry(self.model, "no_other_upstream")
            return None
        if not self.budget.try_retry():
            member.breaker.record(grant, "neutral")
            self.counter.count_retry(self.model, "budget_exhausted")
            return None
        self.counter.count_retry(self.model, "retried")
        return Attempt(member, grant, failed.number + 1, self.tokens)

    async def _move_to(self, nxt: Attempt, take: Callable[[Member], Awaitable[None]],
                       backoff_s: float) -> None:
        """Back off, then take a capacity slot on ``nxt``'s member."""
        nxt.begin()
        self.attempt = nxt
        self._tried.add(nxt.member.key)
        try:
            span = self.trace.start(BACKOFF, {
                "sluice.attempt": nxt.number, "sluice.upstream.member": nxt.member.url})
            try:
                await asyncio.sleep(backoff_s)
            finally:
                self.trace.end(span, **{"sluice.backoff_ms": round(backoff_s * 1000, 3)})
            await take(nxt.member)
        except TimeoutError:
            nxt.done("neutral")
            raise GatewayTimeout("the request's deadline passed while retrying",
                                 code="deadline_exceeded") from None
        except BaseException:
            nxt.done("neutral")
            raise
