"""How long a tenant's requests hold a concurrency slot, and so when a refused one should
come back. Integers in microseconds of the store's clock; `lua/lib.lua` mirrors these
functions (`observe_hold`, `hold_wait`).

At a ``max_concurrency`` refusal the store knows the tenant's live leases (when each
expires, when each was reserved) and how long the tenant's past requests held their slot,
reserve to settle, measured on its own clock (Redis ``TIME``), whichever replica served
them. It does not know how far a running request has got: token counts live only in the
memory of the replica relaying it. So the wait is predicted from durations and ages, with
the estimator TCP uses for round trips (RFC 6298, gains 1/8 and 1/4):

    each settle that used tokens, held = settle time − reserve time:
        first:  mean = held                 dev = held / 2
        then:   mean += (held − mean) / 8   dev += (|held − mean| − dev) / 4

    a refusal, age = now − reserve time of the oldest live lease:
        wait = max(MIN_WAIT, min(lease bound, max(mean − age, dev)))
        no settle yet: max(MIN_WAIT, min(lease bound, COLD_WAIT))

Why this is the wait for the *first* slot to free: one estimate covers every request of
the tenant, so the oldest is predicted to end first (``mean − age`` is least for the
largest age). A request already past the mean is predicted to end within the estimate's
own typical error (``dev``), never "now": a client told ~0 would spend its retries in a
burst. The lease bound (the earliest lease expiry) is when a slot frees for certain, even
if its replica died, so no wait exceeds it; the floor keeps a wait positive (a lease
about to expire is answered with MIN_WAIT, not microseconds). With no history the wait
is one second, RFC 6298's initial timeout, a poll until the first settle teaches the mean.

Settlements at zero tokens are not samples: they were refused downstream (the queue shed
them), undone, or left before anything was generated, and would drag the mean towards 0.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_WAIT_US = 100_000     # no wait below 100 ms
COLD_WAIT_US = 1_000_000  # no history yet: poll every second


@dataclass(slots=True, frozen=True)
class HoldEstimate:
    """A tenant's smoothed slot-hold time and its mean deviation, in µs."""

    mean_us: int
    dev_us: int


def observe(est: HoldEstimate | None, held_us: int) -> HoldEstimate:
    """The estimate after one more request held its slot `held_us` (clamped at 0)."""
    held = max(0, held_us)
    if est is None:
        return HoldEstimate(held, held // 2)
    err = held - est.mean_us
    return HoldEstimate(est.mean_us + err // 8, est.dev_us + (abs(err) - est.dev_us) // 4)


def wait_us(est: HoldEstimate | None, oldest_age_us: int, bound_us: int) -> int:
    """The predicted wait for a slot: the oldest live lease is `oldest_age_us` old and the
    earliest lease expiry is `bound_us` away. Never below MIN_WAIT_US; above `bound_us`
    only when that is itself below MIN_WAIT_US."""
    guess = COLD_WAIT_US if est is None else max(est.mean_us - oldest_age_us, est.dev_us)
    return max(MIN_WAIT_US, min(bound_us, guess))
