"""Weighted order statistics: the percentiles of a bootstrap replicate without building it.

A replicate is a count vector w (how often each arrival was drawn), and its pooled sample
is every value repeated w[owner] times; it is never materialised. The values are sorted
once and cut into B equal bins; ``w @ hist`` (hist[i, j] = values of arrival i in bin j)
gives the replicate's count per bin, a cumulative sum picks the bin holding rank k, and a
cumulative sum of the weights inside that one bin picks the value. The result is exactly
np.percentile (linear) of the concatenated replicate. Only the bins within six sigma of
the sample's quantile rank enter the product (``_window``); a replicate whose rank falls
outside takes the full histogram, so the window saves time and never changes a result.
Cost about R·n·|window| + R·N/B instead of R·N·log N (N values, B ≈ 4√N).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]

STATS = ("p50", "p90", "p99", "mean")
QUANTILES = (0.50, 0.90, 0.99)


@dataclass(slots=True, frozen=True, eq=False)
class Pooled:
    """One metric's values over a group's arrivals, sorted, with what a replicate needs."""

    values: Floats  # every value, sorted
    owner: Ints  # arrival index of each value
    n: int  # arrivals (some may own no value)
    edges: Ints  # bin j holds sorted positions edges[j] .. edges[j + 1] - 1
    hist: npt.NDArray[np.float32]  # n x bins: values of arrival i in bin j
    sums: Floats  # per arrival: sum of its values
    counts: Floats  # per arrival: number of its values
    # per quantile: the bins [lo, hi) where replicates' ranks almost surely fall, and each
    # arrival's count of values below bin lo
    windows: tuple[tuple[int, int, Floats], ...]


def _window(owner: Ints, edges: Ints, n: int, lengths: Ints, q: float,
            ) -> tuple[int, int, Floats]:
    """Bins around the sample's q-quantile holding a replicate's rank q·T but for a six
    sigma miss (then the replicate takes the full pass: the window saves time, never
    changes a result). The rank's spread: sum_i w_i d_i, with d_i the values of arrival i
    up to the quantile less q·len_i, and w multinomial."""
    size = len(owner)
    s = int(q * (size - 1))
    d = np.bincount(owner[: s + 1], minlength=n) - q * lengths
    half = int(6 * math.sqrt(n * float(d.var()))) + 2
    lo = int(np.searchsorted(edges, max(0, s - half), side="right")) - 1
    hi = int(np.searchsorted(edges, min(size - 1, s + half), side="right"))
    below = np.bincount(owner[: edges[lo]], minlength=n).astype(np.float64)
    return lo, min(hi, len(edges) - 1), below


def pooled(lists: Sequence[Sequence[float]]) -> Pooled:
    """Index per-arrival value lists (empty for an arrival without the metric)."""
    n = len(lists)
    lengths = np.array([len(v) for v in lists], dtype=np.int64)
    flat = np.fromiter((x for v in lists for x in v), dtype=np.float64, count=int(lengths.sum()))
    owners = np.repeat(np.arange(n, dtype=np.int64), lengths)
    order = np.argsort(flat, kind="stable")
    values, owner = flat[order], owners[order]
    size = len(values)
    bins = max(1, min(4 * math.isqrt(size), 4_000_000 // max(1, n), size))
    edges = (np.arange(bins + 1, dtype=np.int64) * size) // bins
    bin_of = np.repeat(np.arange(bins, dtype=np.int64), np.diff(edges))
    hist = np.bincount(owner * bins + bin_of, minlength=n * bins).reshape(n, bins)
    sums = np.bincount(owners, weights=flat, minlength=n).astype(np.float64)
    windows = tuple(_window(owner, edges, n, lengths, q) for q in QUANTILES) if size else ()
    return Pooled(values, owner, n, edges, hist.astype(np.float32), sums,
                  lengths.astype(np.float64), windows)


def _order_stats(p: Pooled, w: Floats, cum: Floats, first: int, base: Floats, k0: Floats,
                 k1: Floats) -> tuple[Floats, Floats]:
    """Per replicate row: the values at 0-based ranks k0 <= k1 of its pooled sample, given
    the cumulative counts ``cum`` of bins first.. (``base``: the count below them), which
    must hold both ranks. Both come from the cumulative weights of k0's bin (k1 = k0 + 1
    almost always lies in it); the rows where it does not take a second pass."""
    rows = np.arange(len(w))
    jl = np.minimum((cum <= k0[:, None]).sum(axis=1), cum.shape[1] - 1)
    before = np.where(jl > 0, cum[rows, np.maximum(jl - 1, 0)], base)
    j = jl + first
    start, size = p.edges[j], p.edges[j + 1] - p.edges[j]
    m = np.arange(int(np.diff(p.edges).max()))
    pos = np.minimum(start[:, None] + m, len(p.values) - 1)
    wt = np.where(m < size[:, None], w[rows[:, None], p.owner[pos]], 0.0)
    cw = np.cumsum(wt, axis=1)
    off0 = (cw <= (k0 - before)[:, None]).sum(axis=1)
    off1 = (cw <= (k1 - before)[:, None]).sum(axis=1)
    last = len(p.values) - 1
    lo = p.values[np.minimum(start + off0, last)]
    hi = p.values[np.minimum(start + off1, last)]
    out = off1 >= size
    if out.any():
        hi[out] = _order_stats(p, w[out], cum[out], first, base[out], k1[out], k1[out])[0]
    return lo, hi


def _cum(p: Pooled, w32: npt.NDArray[np.float32], lo: int, hi: int) -> Floats:
    # float32 is exact here: a bin's count in a replicate is far below 2**24
    return np.cumsum((w32 @ p.hist[:, lo:hi]).astype(np.float64), axis=1)


def weighted_stats(p: Pooled, w: Floats) -> Floats:
    """STATS (rows) of each replicate (columns) given its arrival counts ``w`` (r x n);
    NaN for a replicate that drew no value."""
    r = len(w)
    out = np.full((len(STATS), r), np.nan)
    if not len(p.values):
        return out
    total = w @ p.counts
    ok = total > 0
    if not ok.any():
        return out
    w, total = w[ok], total[ok]
    w32 = w.astype(np.float32)
    full: Floats | None = None
    for i, (q, (lo, hi, below)) in enumerate(zip(QUANTILES, p.windows, strict=True)):
        h = (total - 1) * q
        k0 = np.floor(h)
        k1 = np.minimum(k0 + 1, total - 1)
        base = w @ below
        cum = base[:, None] + _cum(p, w32, lo, hi)
        inside = (base <= k0) & (k1 < cum[:, -1])
        a, b = np.empty(len(w)), np.empty(len(w))
        a[inside], b[inside] = _order_stats(p, w[inside], cum[inside], lo, base[inside],
                                            k0[inside], k1[inside])
        if not inside.all():  # a six sigma replicate: the whole histogram
            full = _cum(p, w32, 0, len(p.edges) - 1) if full is None else full
            x = ~inside
            a[x], b[x] = _order_stats(p, w[x], full[x], 0, np.zeros(int(x.sum())), k0[x],
                                      k1[x])
        out[i, ok] = a + (h - k0) * (b - a)
    out[len(QUANTILES), ok] = (w @ p.sums) / total
    return out


def point_stats(values: Floats) -> list[float | None]:
    """STATS of one sample (numpy's linear percentiles), None when it is empty."""
    if not len(values):
        return [None] * len(STATS)
    qs = np.percentile(values, [q * 100 for q in QUANTILES])
    return [*(float(x) for x in qs), float(values.mean())]
