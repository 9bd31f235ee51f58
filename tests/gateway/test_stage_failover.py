"""The failover stage alone: routing, judging each member once, and the retry rules, over
narrow callables (no relay, no server)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.errors import (
    BadRequest,
    GatewayTimeout,
    InternalError,
    RevisionMismatch,
    RevisionUnavailable,
    ServiceUnavailable,
)
from gateway.failover import Attempt, CircuitOpen, Failover
from gateway.outcome import Outcome, classify
from gateway.pool import Member
from gateway.tracing import NO_TRACE, NoTrace
from gateway.upstream import Fault
from policies.retry_budget import RetryBudget, RetryPolicy
from protocol.versions import ServedVersions
from tests.gateway.stage_kit import VERSIONS, Spans, config, gateway


class Counts:
    def __init__(self) -> None:
        self.retries: list[tuple[str, str]] = []
        self.failures: list[tuple[str, str]] = []

    def count_retry(self, model: str, outcome: str) -> None:
        self.retries.append((model, outcome))

    def count_failure(self, member: Member, reason: str) -> None:
        self.failures.append((member.url, reason))


def failover(urls: tuple[str, ...] = ("http://a", "http://b"), *, max_attempts: int = 2,
             budget_min_per_s: float = 10.0, trace: NoTrace = NO_TRACE
             ) -> tuple[Failover, Counts, list[Member]]:
    gw = gateway(config(*urls), {})
    up = gw.upstreams["m"]
    counts = Counts()
    budget = RetryBudget(RetryPolicy(max_attempts, 0.1, budget_min_per_s, backoff_base_s=0.0,
                                     backoff_max_s=0.0))
    return Failover("m", up.router, budget, counts, trace, 100, None, "/v1/completions"), \
        counts, up.members


def nothing() -> None:
    pass


def unwell(url: str) -> Fault:
    return Fault("http_500", ServiceUnavailable(f"{url} failed"))


async def test_a_server_fault_is_retried_on_another_member_and_the_slot_moves() -> None:
    spans = Spans()
    fo, counts, members = failover(trace=spans)
    first = fo.first()
    steps: list[str] = []

    async def call(attempt: Attempt) -> str:
        steps.append(f"call {attempt.member.url} {attempt.headers}")
        if attempt.number == 1:
            attempt.status = 500
            raise unwell(attempt.member.url)
        attempt.status = 200
        return "answered"

    async def take(member: Member) -> None:
        steps.append(f"take {member.url}")

    assert await fo.run(call, lambda: False, lambda: steps.append("release"), take) == \
        "answered"
    other = next(m for m in members if m is not first.member)
    trace = [(b"traceparent", b"00-test")]
    # the failed member's slot is given back before the backoff, the next one taken after
    assert steps == [f"call {first.member.url} {trace}", "release", f"take {other.url}",
                     f"call {other.url} {trace}"]
    upstream = spans.named("sluice.upstream")
    assert [(a["sluice.attempt"], a["http.response.status_code"], a["url.path"],
             a["sluice.upstream.member"]) for a in upstream] == [
        (1, 500, "/v1/completions", first.member.url), (2, 200, "/v1/completions", other.url)]
    assert upstream[0]["error.type"] == "http_500" and "error.type" not in upstream[1]
    assert [n for n, _ in spans.ended] == ["sluice.upstream", "sluice.retry.backoff",
                                           "sluice.upstream"]
    assert counts.failures == [(first.member.url, "http_500")]
    assert counts.retries == [("m", "retried")]
    # each member judged once: the failure on the first, the success on the second
    assert first.member.breaker.state == "closed"
    assert all(m.inflight_requests == 0 and m.inflight_tokens == 0 for m in members)


async def no_retry(fo: Failover, error: Exception, *, started: bool = False) -> None:
    """Run ``fo`` where every call raises ``error``: it (a fault's client error) must reach
    the caller, the slot never moved."""
    async def call(attempt: Attempt) -> None:
        raise error

    async def take(member: Member) -> None:
        raise AssertionError("must not move")

    with pytest.raises(type(error.err if isinstance(error, Fault) else error)):
        await fo.run(call, lambda: started, nothing, take)


async def test_no_retry_once_the_client_has_bytes() -> None:
    fo, counts, _ = failover()
    fo.first()
    await no_retry(fo, unwell("a"), started=True)
    assert counts.retries == []  # not a retry decision: the answer had begun


async def test_a_refusal_is_not_retried_and_says_nothing_of_the_server() -> None:
    fo, counts, _ = failover()
    first = fo.first()
    await no_retry(fo, BadRequest("no", "model"))
    assert counts.failures == [] and counts.retries == []
    assert first.recorded and first.member.inflight_requests == 0
    assert first.member.breaker.state == "closed"


async def test_attempts_exhausted_returns_the_last_error_to_the_client() -> None:
    fo, counts, _ = failover(max_attempts=1)
    fo.first()
    await no_retry(fo, unwell("a"))
    assert counts.retries == [("m", "attempts_exhausted")]


async def test_a_lone_member_has_no_other_to_try() -> None:
    fo, counts, _ = failover(("http://a",))
    fo.first()
    await no_retry(fo, unwell("a"))
    assert counts.retries == [("m", "no_other_upstream")]


async def test_every_breaker_open_is_a_503_with_retry_after() -> None:
    fo, counts, members = failover(("http://a",))
    breaker = members[0].breaker
    while (granted := breaker.try_pass()) is not None:  # fail until it opens
        breaker.record(granted, "failure")
    assert breaker.state == "open"
    with pytest.raises(CircuitOpen) as caught:
        fo.first()
    assert caught.value.retry_after_s is not None and caught.value.retry_after_s > 0
    assert counts.retries == [("m", "all_open")]


async def test_a_cancelled_attempt_is_judged_neutral_and_frees_its_load() -> None:
    fo, _, members = failover(("http://a",))
    first = fo.first()
    started = asyncio.Event()

    async def call(attempt: Attempt) -> None:
        started.set()
        await asyncio.sleep(3600)

    async def take(member: Member) -> None:
        raise AssertionError("must not move")

    task = asyncio.ensure_future(fo.run(call, lambda: False, nothing, take))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    fo.close()
    assert first.recorded and members[0].inflight_requests == 0
    assert members[0].breaker.state == "closed"


@pytest.mark.parametrize(("status", "error", "facts", "want"), [
    (200, None, {"accepted": True, "done": True}, Outcome.SUCCESS),
    (200, None, {"accepted": True, "done": True, "upstream_failed": True},
     Outcome.UPSTREAM_ERROR),
    (200, None, {"accepted": True, "cancelled": True}, Outcome.CANCELLED),
    (0, None, {}, Outcome.CANCELLED),
    (429, None, {}, Outcome.REJECTED_429),
    (503, ServiceUnavailable("x", code="overloaded"), {}, Outcome.REJECTED_503),
    (503, ServiceUnavailable("x", code="draining"), {}, Outcome.UPSTREAM_ERROR),
    (504, GatewayTimeout("x", code="deadline_exceeded"), {}, Outcome.DEADLINE),
    (500, InternalError("x"), {}, Outcome.ERROR),
    (400, BadRequest("x"), {}, Outcome.INVALID),
    (200, BadRequest("x"), {"accepted": True}, Outcome.UPSTREAM_ERROR),
])
def test_one_outcome_vocabulary(status: int, error: object, facts: dict[str, bool],
                                want: Outcome) -> None:
    assert classify(status, error, **facts) is want  # type: ignore[arg-type]


def pinned(pin: str, urls: tuple[str, ...], new: set[str]
           ) -> tuple[Failover, Counts, list[Member]]:
    """A failover for a request pinned to ``pin``: the members at ``new`` serve another
    revision than the rest (the config's)."""
    fo, counts, members = failover(urls, max_attempts=len(urls))
    for m in members:
        if m.url in new:
            m.versions = ServedVersions("d" * 40, "t", None, "e")
    return Failover("m", fo.router, fo.budget, counts, NO_TRACE, 100, None,
                    "/v1/completions", pin), counts, members


async def test_a_pinned_request_is_retried_only_on_members_serving_its_revision() -> None:
    urls = ("http://a", "http://b", "http://c")
    fo, counts, members = pinned(VERSIONS.revision[:8], urls, {"http://c"})
    tried: list[str] = []

    async def call(attempt: Attempt) -> None:
        tried.append(attempt.member.url)
        if attempt.number == 1:
            raise unwell(attempt.member.url)
        # the second member moved to another revision under the attempt: neutral
        raise Fault("revision_moved", RevisionMismatch("moved"), neutral=True)

    async def take(member: Member) -> None:
        pass

    fo.first()
    with pytest.raises(RevisionMismatch):
        await fo.run(call, lambda: False, nothing, take)
    assert sorted(tried) == ["http://a", "http://b"]  # never c, which serves another
    assert counts.retries == [("m", "retried"), ("m", "no_other_upstream")]
    assert counts.failures == [(tried[0], "http_500")]  # the move is not a failure
    moved = next(m for m in members if m.url == tried[1])
    assert moved.breaker.failures == 0 and moved.inflight_requests == 0


async def test_a_member_that_moved_is_left_for_one_still_serving_the_pin() -> None:
    fo, counts, members = pinned(VERSIONS.revision, ("http://a", "http://b"), set())
    first = fo.first()

    async def call(attempt: Attempt) -> str:
        if attempt.member is first.member:
            raise Fault("revision_moved", RevisionMismatch("moved"), neutral=True)
        return attempt.member.url

    async def take(member: Member) -> None:
        pass

    other = next(m for m in members if m is not first.member)
    assert await fo.run(call, lambda: False, nothing, take) == other.url
    assert counts.failures == [] and first.member.breaker.failures == 0


async def test_a_pin_no_member_serves_is_a_503_revision_unavailable() -> None:
    fo, counts, members = pinned("d" * 8, ("http://a", "http://b"), set())
    with pytest.raises(RevisionUnavailable) as caught:
        fo.first()
    err = caught.value
    assert (err.status, err.code, err.param) == (503, "revision_unavailable", "model")
    assert err.retry_after_s == 3600  # the refresh interval: when it could be known
    assert counts.retries == []
    assert all(m.inflight_requests == 0 for m in members)
    # unknown versions never take a pin: b's are unknown, a serves another revision
    fo, _, members = pinned(VERSIONS.revision, ("http://a", "http://b"), {"http://a"})
    members[1].versions = None
    with pytest.raises(RevisionUnavailable):
        fo.first()
