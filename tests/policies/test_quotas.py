"""Value objects and bucket arithmetic, without a store."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies import buckets
from policies.quotas import Quotas, RateHeaders, format_reset

US = buckets.US


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (0.25, "250ms"), (0.0004, "1ms"), (0.999, "999ms"), (1, "1s"), (1.5, "1.5s"),
    (59.9991, "1m0s"), (60, "1m0s"), (360, "6m0s"), (61.25, "1m1.25s"), (3600, "1h0m0s"),
    (-3, "0s"),
])
def test_reset_is_formatted_like_openai(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


def test_as_headers_lists_only_limited_buckets() -> None:
    both = RateHeaders(60, 59, 1.0, 6000, 5000, 10.0)
    assert both.as_headers() == [
        (b"x-ratelimit-limit-requests", b"60"), (b"x-ratelimit-remaining-requests", b"59"),
        (b"x-ratelimit-reset-requests", b"1s"), (b"x-ratelimit-limit-tokens", b"6000"),
        (b"x-ratelimit-remaining-tokens", b"5000"), (b"x-ratelimit-reset-tokens", b"10s")]
    assert RateHeaders(None, None, None, 100, 0, 0.25).as_headers() == [
        (b"x-ratelimit-limit-tokens", b"100"), (b"x-ratelimit-remaining-tokens", b"0"),
        (b"x-ratelimit-reset-tokens", b"250ms")]
    assert RateHeaders().as_headers() == []


@pytest.mark.parametrize("bad", [-1, 1.5, True, "10"])
def test_quotas_refuse_nonsense(bad: object) -> None:
    with pytest.raises(ValueError):
        Quotas(tokens_per_minute=bad)  # type: ignore[arg-type]


caps = st.integers(min_value=1, max_value=10**7)


@given(cap=caps, level=st.integers(-(10**13), 10**13), cost=st.integers(0, 10**7),
       start=st.integers(0, 10**15))
def test_waiting_the_wait_is_exactly_enough(cap: int, level: int, cost: int, start: int) -> None:
    level = min(level, cap * US)
    wait = buckets.wait_us(level, cap, cost)
    if cost > cap:
        assert wait is None
        return
    assert wait is not None
    assert buckets.refill(level, start, start + wait, cap) >= cost * US
    if wait > 0:
        assert buckets.refill(level, start, start + wait - 1, cap) < cost * US


@given(cap=caps, level=st.integers(-(10**13), 10**13), a=st.integers(0, 10**9),
       b=st.integers(0, 10**9))
def test_refill_is_monotonic_and_capped(cap: int, level: int, a: int, b: int) -> None:
    level = min(level, cap * US)
    early, late = sorted((a, b))
    assert level <= buckets.refill(level, 0, early, cap) <= buckets.refill(level, 0, late, cap)
    assert buckets.refill(level, 0, late, cap) <= cap * US
    full_at = buckets.reset_us(level, cap)
    assert buckets.refill(level, 0, full_at, cap) == cap * US
