"""The arrival schedule: when each request is due and what it asks for, from the seed alone.

The whole schedule is drawn before the run starts, so the client only has to keep time,
and the same seed gives the same schedule on any machine (numpy's PCG64 streams). Times
and request attributes come from separate streams: changing the rate (the sweep) moves
the arrivals but keeps the n-th request's class, lengths and patience.

Time-varying rates (piecewise, diurnal) are non-homogeneous Poisson processes drawn by
thinning (Lewis and Shedler): candidates at the peak rate, each kept with probability
rate(t)/peak, which gives exactly the intended rate at every instant.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from loadtest.workload import ClassSpec, Patience, Workload

_TIMES, _ATTRS = 1, 2  # stream ids under the workload's seed


@dataclass(slots=True, frozen=True)
class Planned:
    """One scheduled request. ``t`` is seconds from the run's start."""

    idx: int
    t: float
    cls: str
    input_tokens: int
    output_tokens: int
    tenant: str
    priority: int | None
    patience_s: float | None  # abandon if no first token by then
    cancel_after: int | None  # abandon after this many output tokens
    measured: bool  # inside [warmup_s, duration_s - cooldown_s)


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])


def _renewal(rng: np.random.Generator, duration: float,
             gap: Callable[[np.random.Generator], float]) -> list[float]:
    out, t = [], gap(rng)
    while t < duration:
        out.append(t)
        t += gap(rng)
    return out


def _thinned(rng: np.random.Generator, duration: float, rate: Callable[[float], float],
             peak: float) -> list[float]:
    out: list[float] = []
    t = 0.0
    if peak <= 0:
        return out
    while True:
        t += rng.exponential(1.0 / peak)
        if t >= duration:
            return out
        if rng.random() * peak < rate(t):
            out.append(t)


def arrival_times(w: Workload) -> list[float]:
    """Scheduled send times in [0, duration_s), ascending."""
    a, d = w.arrival, w.duration_s
    assert a is not None, "a closed-loop workload has no arrival times"
    rng = _rng(w.seed, _TIMES)
    if a.process == "constant":
        rate = float(a.rate or 0)
        return [i / rate for i in range(math.ceil(d * rate)) if i / rate < d]
    if a.process == "poisson":
        rate = float(a.rate or 0)
        return _renewal(rng, d, lambda g: float(g.exponential(1.0 / rate)))
    if a.process == "gamma":
        # Gamma gaps with mean 1/rate; CV^2 = 1/shape, so shape < 1 is burstier than Poisson.
        rate, shape = float(a.rate or 0), float(a.shape or 1)
        return _renewal(rng, d, lambda g: float(g.gamma(shape, 1.0 / (rate * shape))))
    if a.process == "piecewise":
        pieces = a.pieces or []

        def piece_rate(t: float) -> float:
            for p in pieces:
                if t < p.until_s:
                    return p.rate
            return pieces[-1].rate

        return _thinned(rng, d, piece_rate, max(p.rate for p in pieces))
    if a.process == "diurnal":
        mean, amp, period = float(a.rate or 0), float(a.amplitude or 0), float(a.period_s or 1)
        return _thinned(rng, d, lambda t: mean * (1 + amp * math.sin(2 * math.pi * t / period)),
                        mean * (1 + amp))
    return [r.t for r in a.rows if r.t < d]  # replay


def _patience(p: Patience, v: float, z: float) -> float:
    """Patience in seconds from a uniform ``v`` and a standard normal ``z``."""
    median_s = p.median / 1000
    if p.dist == "fixed":
        return median_s
    if p.dist == "exponential":  # median = ln2 * mean
        return -math.log1p(-v) * median_s / math.log(2)
    return median_s * math.exp(p.sigma * z)


def _pick(u: float, weights: list[float]) -> int:
    """An index drawn with probability proportional to its weight, from one uniform ``u``."""
    u *= sum(weights)
    for i, x in enumerate(weights):
        u -= x
        if u < 0:
            return i
    return len(weights) - 1


def _attributes(c: ClassSpec, draw: tuple[float, float, float, float],
                ) -> tuple[int, int, float | None, int | None]:
    pairs = c.length_pairs()
    pick, u, v, z = draw
    i, o, _ = pairs[_pick(pick, [p[2] for p in pairs])]
    patience, after = None, None
    if c.cancel is not None and u < c.cancel.share:
        patience = (None if c.cancel.patience_ms is None
                    else _patience(c.cancel.patience_ms, v, z))
        after = c.cancel.after_tokens
    return i, o, patience, after


def _draws(w: Workload) -> Iterator[tuple[int, tuple[float, float, float, float]]]:
    """(class index, the class's four draws) of request 0, 1, 2, ...: one stream, the same
    numbers for every request whatever its class (so one class's settings never shift the
    others), drawn in order, so the n-th request is the same in open and closed loop."""
    rng = _rng(w.seed, _ATTRS)
    shares = [c.share for c in w.classes]
    while True:
        k = _pick(float(rng.random()), shares)
        yield k, (float(rng.random()), float(rng.random()), float(rng.random()),
                  float(rng.standard_normal()))


def schedule(w: Workload) -> list[Planned]:
    """Every request of an open-loop run, in send order (``requests`` caps the count)."""
    assert w.arrival is not None, "a closed-loop workload has no schedule"
    times = arrival_times(w)[: w.requests]
    start, end = w.window()
    rows = w.arrival.rows if w.arrival.process == "replay" else ()
    out = []
    for n, (t, (k, draw)) in enumerate(zip(times, _draws(w))):
        row = rows[n] if rows else None
        if row is not None and row.class_ is not None:
            k = next(j for j, c in enumerate(w.classes) if c.name == row.class_)
        c = w.classes[k]
        i, o, patience, after = _attributes(c, draw)
        if row is not None:
            i, o = row.input, row.output
        out.append(Planned(
            idx=n, t=t, cls=c.name, input_tokens=i, output_tokens=o,
            tenant=(row.tenant if row is not None and row.tenant else c.label),
            priority=(row.priority if row is not None and row.priority is not None
                      else c.priority),
            patience_s=patience, cancel_after=after, measured=start <= t < end))
    return out


def cap_requests(w: Workload) -> Workload:
    """Open loop with ``requests``: the schedule ends where the (requests+1)-th arrival would
    be, so the rates divide by the time the requests took to arrive (arrival times drawn
    for a shorter duration are a prefix of the longer draw's)."""
    if w.arrival is None or w.requests is None:
        return w
    times = arrival_times(w)
    if len(times) <= w.requests:
        return w
    end = times[w.requests]
    if w.warmup_s + w.cooldown_s >= end:
        raise ValueError(f"requests: {w.requests} requests arrive within {end:.3g} s, not "
                         f"after warmup_s + cooldown_s ({w.warmup_s + w.cooldown_s:g} s)")
    return w.model_copy(update={"duration_s": end})


def requests_in_order(w: Workload) -> Iterator[Planned]:
    """Closed loop: the requests in send order, without times (``t`` is filled in when each
    is sent; ``measured`` then follows from it)."""
    for n, (k, draw) in enumerate(_draws(w)):
        c = w.classes[k]
        i, o, patience, after = _attributes(c, draw)
        yield Planned(idx=n, t=0.0, cls=c.name, input_tokens=i, output_tokens=o,
                      tenant=c.label, priority=c.priority, patience_s=patience,
                      cancel_after=after, measured=False)
