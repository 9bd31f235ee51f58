"""Serving metrics: counters, gauges and histograms with bounded label sets.

The hot path records into plain Python objects (a dict lookup, a bisect, an add): the
gateway observes an inter-token latency per relayed chunk, thousands a second, where the
OpenTelemetry SDK's ``Histogram.record`` costs several microseconds. Scrape-time values
(queue depths, engine state) come from collectors, functions called at render time. A
``Registry`` renders Prometheus text (format 0.0.4) and hands its families to the OTLP
metrics pusher (``telemetry.push``).

Cardinality is bounded per metric: once a label has seen ``max_label_values`` distinct
values, further new values are recorded under ``_other`` (tenants are user-created; a
scrape must not grow without bound).
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OTHER = "_other"

Kind = Literal["counter", "gauge", "histogram"]
Labels = tuple[tuple[str, str], ...]

# Seconds. Queue time, TTFT and E2E span a millisecond to minutes; TPOT/ITL are per token.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25,
                 0.5, 1.0, 2.5)


@dataclass(slots=True)
class HistogramPoint:
    bounds: tuple[float, ...]
    counts: list[int]  # per bucket (not cumulative); the last is +Inf
    sum: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1


@dataclass(slots=True)
class Family:
    """One metric with all its label sets, as collected at one instant."""

    name: str
    kind: Kind
    help: str
    samples: list[tuple[Labels, float]] = field(default_factory=list)  # counter / gauge
    points: list[tuple[Labels, HistogramPoint]] = field(default_factory=list)  # histogram
    unit: str = ""

    def add(self, value: float, **labels: str) -> Family:
        self.samples.append((tuple(labels.items()), value))
        return self


class _Bounded:
    """Maps label values to children, folding values past the bound into ``_other``."""

    def __init__(self, name: str, label_names: Sequence[str], max_values: int) -> None:
        self.name = name
        self.label_names = tuple(label_names)
        self.max_values = max_values
        self._seen: list[set[str]] = [set() for _ in self.label_names]

    def _key(self, values: tuple[str, ...]) -> tuple[str, ...]:
        if len(values) != len(self.label_names):
            raise ValueError(f"{self.name} takes labels {self.label_names}, got {values}")
        out = []
        for seen, value in zip(self._seen, values):
            if value not in seen:
                if len(seen) >= self.max_values:
                    value = OTHER
                seen.add(value)
            out.append(value)
        return tuple(out)

    def _labels(self, key: tuple[str, ...]) -> Labels:
        return tuple(zip(self.label_names, key))


class Counter(_Bounded):
    def __init__(self, name: str, help_text: str, label_names: Sequence[str],
                 max_values: int) -> None:
        super().__init__(name, label_names, max_values)
        self.help = help_text
        self.values: dict[tuple[str, ...], float] = {}
        self._alias: dict[tuple[str, ...], tuple[str, ...]] = {}

    def inc(self, *labels: str, by: float = 1.0) -> None:
        key = self._alias.get(labels)
        if key is None:
            key = self._key(labels)
            if key == labels:  # values folded into _other are not cached: memory stays bounded
                self._alias[labels] = key
        self.values[key] = self.values.get(key, 0.0) + by

    def get(self, *labels: str) -> float:
        return self.values.get(self._alias.get(labels, labels), 0.0)

    def collect(self) -> Family:
        fam = Family(self.name, "counter", self.help)
        fam.samples = [(self._labels(k), v) for k, v in sorted(self.values.items())]
        return fam


class Histogram(_Bounded):
    def __init__(self, name: str, help_text: str, label_names: Sequence[str],
                 bounds: tuple[float, ...], max_values: int) -> None:
        super().__init__(name, label_names, max_values)
        self.help = help_text
        self.bounds = bounds
        self.points: dict[tuple[str, ...], HistogramPoint] = {}
        self._alias: dict[tuple[str, ...], HistogramPoint] = {}

    def child(self, *labels: str) -> HistogramPoint:
        """The point for ``labels``; keep it to observe many values (per-token ITL)."""
        point = self._alias.get(labels)
        if point is None:
            key = self._key(labels)
            point = self.points.get(key)
            if point is None:
                point = self.points[key] = HistogramPoint(self.bounds,
                                                          [0] * (len(self.bounds) + 1))
            if key == labels:  # as Counter.inc: folded values are not cached
                self._alias[labels] = point
        return point

    def observe(self, value: float, *labels: str) -> None:
        self.child(*labels).observe(value)

    def collect(self) -> Family:
        fam = Family(self.name, "histogram", self.help, unit="s")
        fam.points = [(self._labels(k), HistogramPoint(p.bounds, list(p.counts), p.sum, p.count))
                      for k, p in sorted(self.points.items())]
        return fam


class Registry:
    def __init__(self, max_label_values: int = 100) -> None:
        self.max_label_values = max_label_values
        self._instruments: list[Counter | Histogram] = []
        self._collectors: list[Callable[[], Iterable[Family]]] = []
        self.start_ns = time.time_ns()

    def counter(self, name: str, help_text: str, labels: Sequence[str] = ()) -> Counter:
        c = Counter(name, help_text, labels, self.max_label_values)
        self._instruments.append(c)
        return c

    def histogram(self, name: str, help_text: str, labels: Sequence[str] = (),
                  bounds: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
        h = Histogram(name, help_text, labels, bounds, self.max_label_values)
        self._instruments.append(h)
        return h

    def collector(self, fn: Callable[[], Iterable[Family]]) -> None:
        """``fn`` is called at every scrape/export for values read from live state."""
        self._collectors.append(fn)

    def collect(self) -> list[Family]:
        out = [i.collect() for i in self._instruments]
        for fn in self._collectors:
            out.extend(fn())
        return out

    def render(self) -> str:
        return render(self.collect())


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt_labels(labels: Labels, extra: str = "") -> str:
    parts = [f'{k}="{_esc(v)}"' for k, v in labels]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(value: float) -> str:
    if math.isnan(value):  # int(nan) raises: one NaN gauge must not fail the whole scrape
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def render(families: Iterable[Family]) -> str:
    """Prometheus text exposition 0.0.4."""
    out: list[str] = []
    for fam in families:
        help_text = fam.help.replace("\\", "\\\\").replace("\n", "\\n")
        out.append(f"# HELP {fam.name} {help_text}")
        out.append(f"# TYPE {fam.name} {fam.kind}")
        if fam.kind != "histogram":
            out += [f"{fam.name}{_fmt_labels(lb)} {_num(v)}" for lb, v in fam.samples]
            continue
        for lb, p in fam.points:
            acc = 0
            for bound, n in zip(p.bounds, p.counts):
                acc += n
                le = f'le="{bound}"'
                out.append(f"{fam.name}_bucket{_fmt_labels(lb, le)} {acc}")
            inf = 'le="+Inf"'
            out.append(f"{fam.name}_bucket{_fmt_labels(lb, inf)} {p.count}")
            out.append(f"{fam.name}_sum{_fmt_labels(lb)} {_num(p.sum)}")
            out.append(f"{fam.name}_count{_fmt_labels(lb)} {p.count}")
    return "\n".join(out) + "\n"


class PoolCounts(Protocol):
    """What a work pool reports (``protocol.offload.PoolSnapshot`` has these)."""

    @property
    def running(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def tenants(self) -> int: ...
    @property
    def refused_tenant(self) -> int: ...
    @property
    def refused_full(self) -> int: ...


def pool_families(prefix: str, pool: PoolCounts, *, name: str, jobs: str,
                  reasons: tuple[str, str]) -> Iterator[Family]:
    """A work pool's gauges and refusals, the same on every server: ``{prefix}{name}_running``,
    ``_waiting``, ``_tenants`` and ``_refused_total{reason}`` (``reasons``: the tenant's
    share full, 429; the queue full, 503); ``jobs`` says what the pool works on."""
    tenant, full = reasons
    yield Family(f"{prefix}{name}_running", "gauge",
                 f"{jobs} being worked on in the {name} pool.").add(pool.running)
    yield Family(f"{prefix}{name}_waiting", "gauge",
                 f"{jobs} waiting for a worker of the {name} pool.").add(pool.waiting)
    yield Family(f"{prefix}{name}_tenants", "gauge",
                 f"Tenants with {jobs.lower()} running or waiting in the {name} pool.")\
        .add(pool.tenants)
    yield (Family(f"{prefix}{name}_refused_total", "counter",
                  f"{jobs} the {name} pool refused: {tenant} (429, the tenant's share is "
                  f"full), {full} (503, the queue is full or a worker died).")
           .add(pool.refused_tenant, reason=tenant)
           .add(pool.refused_full, reason=full))


def priority_class(priority: int) -> str:
    """A bounded label for a numeric priority (lower is more urgent, vLLM's convention)."""
    if priority <= 0:
        return "p0"
    if priority <= 3:
        return "p1-3"
    if priority <= 6:
        return "p4-6"
    return "p7+"
