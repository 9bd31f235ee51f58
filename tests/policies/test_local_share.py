"""The fail-open local share, side by side with aiolimiter (issue #26).

The same deterministic arrivals run against the local share as the gateway builds it (a
``MemoryStore`` holding ``local_share(quotas, replicas)``) and against aiolimiter's
``AsyncLimiter`` used the only way a gateway could (``has_capacity`` to refuse, never an
``acquire`` that waits). One fake clock drives both: the store's injected clock and the
event loop's ``time()``, which aiolimiter reads. Nothing sleeps. The figures asserted here
are the ones docs/admission.md quotes."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiolimiter import AsyncLimiter

from policies.local_share import local_share
from policies.memory import MemoryStore
from policies.quotas import Quotas

T = TypeVar("T")
START = 1_767_232_800.0  # 2026-01-01 02:00 UTC: the day's budget resets in 22 h
UPTIME = 1000.0  # the loop's monotonic clock when the store's reads START
TTL = 60.0


class FakeTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only when a test moves it. As in production, the
    store reads wall-clock seconds (``now``, for its calendar periods) and aiolimiter the
    loop's monotonic clock; both move together."""

    def __init__(self) -> None:
        super().__init__()
        self.t = 0.0  # seconds since START

    def time(self) -> float:
        return UPTIME + self.t

    def wall(self) -> float:
        return START + self.t


def on_fake_loop(body: Callable[[FakeTimeLoop], Awaitable[T]]) -> T:
    loop = FakeTimeLoop()
    try:
        return loop.run_until_complete(body(loop))
    finally:
        loop.close()


class AioBucket:
    """A per-minute limit on aiolimiter, refusing instead of waiting. Its Retry-After reads
    the limiter's private ``_level``: it has no public one (see the test below)."""

    def __init__(self, per_minute: int) -> None:
        self.limiter = AsyncLimiter(per_minute, 60)

    async def take(self, amount: int) -> float:
        """0.0 when granted (taken), else the wait in seconds, rounded up to whole µs as
        the store rounds."""
        lim = self.limiter
        if lim.has_capacity(amount):
            await lim.acquire(amount)  # returns at once: has_capacity said so
            return 0.0
        return math.ceil(self.naive_wait(amount) * 1e6) / 1e6

    def naive_wait(self, amount: int) -> float:
        lim = self.limiter
        return (lim._level + amount - lim.max_rate) / (lim.max_rate / lim.time_period)


def test_rpm_side_by_side_same_admitted_counts_and_waits() -> None:
    """requests_per_minute 30 over 3 replicas (a share of 10): a burst of 25 at once, then
    one request every 0.7 s for 120 s. Both admit the same requests (19 in the first
    minute, 10 in the second) and name the same wait, to 0.1 ms, for each refused one.
    (The arrivals miss the refill instants by 13 ms: within a few µs of one, the store's
    whole-µs clock and aiolimiter's float one can round a request either way.)"""
    share = local_share(Quotas(requests_per_minute=30), 3)
    assert share.requests_per_minute == 10

    async def body(loop: FakeTimeLoop) -> tuple[list[int], list[int], int]:
        store = MemoryStore(clock=loop.wall)
        aio = AioBucket(10)
        arrivals = [0.0] * 25 + [0.013 + 0.7 * i for i in range(1, 172)]
        mem_ok, aio_ok = [0, 0], [0, 0]
        refused = 0
        for i, at in enumerate(arrivals):
            loop.t = at
            d = await store.reserve("t", f"r{i}", 1, share, TTL)
            wait = await aio.take(1)
            minute = int(at // 60)
            mem_ok[minute] += d.granted
            aio_ok[minute] += wait == 0.0
            assert d.granted == (wait == 0.0), (i, at, d, wait)
            if not d.granted:
                refused += 1
                assert d.retry_after_s is not None
                assert abs(d.retry_after_s - wait) <= 1e-4, (i, d.retry_after_s, wait)
        return mem_ok, aio_ok, refused

    mem_ok, aio_ok, refused = on_fake_loop(body)
    assert mem_ok == aio_ok == [19, 10]
    assert refused == 196 - 29


def test_tpm_side_by_side_aiolimiter_cannot_refund_at_settle() -> None:
    """tokens_per_minute 30,000 over 3 replicas (a share of 10,000). One request a second
    for 60 s, each reserving its worst case (2,000 tokens: prompt + max_tokens) and using
    200, settled before the next. The store refunds the unused 1,800 at settle and admits
    all 60; AsyncLimiter has no release, so it admits 9 (a burst of 5, then one each
    time 12 s of leak free 2,000 tokens)."""
    share = local_share(Quotas(tokens_per_minute=30_000), 3)
    assert share.tokens_per_minute == 10_000

    async def body(loop: FakeTimeLoop) -> tuple[int, int]:
        store = MemoryStore(clock=loop.wall)
        aio = AioBucket(10_000)
        mem_ok = aio_ok = 0
        for i in range(60):
            loop.t = i
            d = await store.reserve("t", f"r{i}", 2_000, share, TTL)
            if d.granted:
                mem_ok += 1
                assert await store.settle("t", f"r{i}", 200)
            if await aio.take(2_000) == 0.0:
                aio_ok += 1  # and at settle: nothing to call, the 1,800 stay taken
        return mem_ok, aio_ok

    assert on_fake_loop(body) == (60, 9)
    assert not any(hasattr(AsyncLimiter, name) for name in ("release", "refund", "give_back"))


def test_retry_after_from_aiolimiter_needs_its_private_level() -> None:
    """A Retry-After (and x-ratelimit-remaining) needs the bucket's level: AsyncLimiter's
    is ``_level``, private. Read anyway, the float wait it gives is refused at its own
    instant for 79 of the 199 caps 1..199 per minute (a client retrying on time is refused
    again), and for 3 of them (25, 75, 150) even rounded up to whole µs as the store
    rounds; the store's integer-µs wait never is."""
    assert [n for n in dir(AsyncLimiter) if "level" in n] == ["_level"]

    async def body(loop: FakeTimeLoop) -> tuple[int, int, int]:
        naive_refused = rounded_refused = store_refused = 0
        for cap in range(1, 200):
            loop.t = 0.0
            aio = AioBucket(cap)
            for _ in range(cap):
                assert await aio.take(1) == 0.0
            naive, rounded = aio.naive_wait(1), await aio.take(1)
            loop.t = naive
            naive_refused += not aio.limiter.has_capacity(1)
            loop.t = rounded
            rounded_refused += not aio.limiter.has_capacity(1)

            loop.t = 0.0
            store = MemoryStore(clock=loop.wall)
            q = Quotas(requests_per_minute=cap)
            for i in range(cap):
                assert (await store.reserve("t", f"r{i}", 1, q, TTL)).granted
            d = await store.reserve("t", "late", 1, q, TTL)
            assert not d.granted and d.retry_after_s is not None
            loop.t = d.retry_after_s
            store_refused += not (await store.reserve("t", "again", 1, q, TTL)).granted
        return naive_refused, rounded_refused, store_refused

    assert on_fake_loop(body) == (79, 3, 0)


def test_a_limiter_beside_the_store_splits_the_decision() -> None:
    """rpm on an AsyncLimiter beside the store (which keeps the rest) cannot be one atomic
    decision: the store takes what it grants, so the limiter is asked first, and its
    refusal is all the tenant hears. With the day's budget share spent and the rpm share
    too, the store answers tokens_per_day until midnight (22 h, x-should-retry: false);
    the split answers requests_per_minute in 6 s, and the retry then is refused again."""
    quotas = local_share(Quotas(requests_per_minute=30, tokens_per_day=3_000), 3)

    async def body(loop: FakeTimeLoop) -> tuple[str | None, float, float]:
        store = MemoryStore(clock=loop.wall)
        for i in range(10):  # the rpm share (10) and the day share (1,000) both spent
            assert (await store.reserve("t", f"r{i}", 100, quotas, TTL)).granted
        d = await store.reserve("t", "next", 100, quotas, TTL)
        assert not d.granted and d.retry_after_s is not None

        rest = Quotas(tokens_per_day=quotas.tokens_per_day)  # the store's part of the split
        split_store = MemoryStore(clock=loop.wall)
        rpm = AioBucket(10)
        for i in range(10):
            assert await rpm.take(1) == 0.0
            assert (await split_store.reserve("t", f"r{i}", 100, rest, TTL)).granted
        split_wait = await rpm.take(1)  # refused here: the store is never asked
        assert split_wait > 0
        loop.t += split_wait
        assert await rpm.take(1) == 0.0
        retried = await split_store.reserve("t", "next", 100, rest, TTL)
        assert not retried.granted and retried.denied_by == "tokens_per_day"
        return d.denied_by, d.retry_after_s, split_wait

    denied_by, store_wait, split_wait = on_fake_loop(body)
    assert denied_by == "tokens_per_day" and store_wait == 22 * 3600
    assert split_wait == 6.0


def test_aiolimiter_waits_where_admission_must_answer_now() -> None:
    """``acquire`` on a spent limiter does not refuse: it parks the request until the
    leak makes room (here 6 s of loop time); admission must answer a 429 at once."""
    async def body(loop: FakeTimeLoop) -> tuple[bool, bool]:
        lim = AsyncLimiter(10, 60)
        for _ in range(10):
            await lim.acquire()
        parked = asyncio.ensure_future(lim.acquire())
        for _ in range(10):
            await asyncio.sleep(0)
        waiting = not parked.done()
        loop.t += 6.0
        for _ in range(100):  # poll, bounded in loop turns, never in wall time
            if parked.done():
                break
            await asyncio.sleep(0)
        return waiting, parked.done()

    assert on_fake_loop(body) == (True, True)


def test_local_share_divides_every_limit_rounding_down() -> None:
    q = Quotas(tokens_per_minute=10_001, requests_per_minute=7, tokens_per_day=5,
               tokens_per_month=None, max_concurrency=2)
    assert local_share(q, 3) == Quotas(tokens_per_minute=3_333, requests_per_minute=2,
                                       tokens_per_day=1, tokens_per_month=None,
                                       max_concurrency=0)
    assert local_share(q, 1) == q
    try:
        local_share(q, 0)
    except ValueError:
        pass
    else:
        raise AssertionError("replicas 0 accepted")
