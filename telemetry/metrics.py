"""Serving metrics on ``prometheus_client``: counters and histograms with bounded label sets,
plus scrape-time families read from live state.

A ``Registry`` owns one ``prometheus_client.CollectorRegistry`` (many gateways and backends
share a test process, so never the library's global one). Instruments are the library's
``Counter`` and ``Histogram``; scrape-time values (queue depths, engine state) come from
collectors, functions called at every scrape that yield ``Family`` objects, turned into the
library's metric families by ``_Families``. ``render()`` is the library's Prometheus text
(format 0.0.4); ``collect()`` hands the same families to the OTLP pusher (``telemetry.push``).

Cardinality is bounded per label: once a label of a metric has seen ``max_label_values``
distinct values, further new values are recorded under ``_other`` (tenants are
user-created; a scrape must not grow without bound). The hot path stays one dict lookup
(label values → the library's child) plus the library's call: label tuples within the bound
are cached; folded ones are not, so that cache is bounded too.

The library's ``_created`` series are switched off (``disable_created_metrics``, a
process-wide setting of the library): the exposition keeps the series it always had.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, Protocol, TypeVar

from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client import Counter as PromCounter
from prometheus_client import Histogram as PromHistogram
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "LATENCY_BUCKETS", "OTHER", "TOKEN_BUCKETS", "Counter", "Family",
           "Histogram", "Kind", "Observer", "Registry", "pool_families", "priority_class"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OTHER = "_other"

Kind = Literal["counter", "gauge"]
Labels = tuple[tuple[str, str], ...]

# Seconds. Queue time, TTFT and E2E span a millisecond to minutes; TPOT/ITL are per token.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25,
                 0.5, 1.0, 2.5)


class Observer(Protocol):
    """One histogram series, kept by a caller that observes many values (per-token ITL)."""

    def observe(self, value: float, /) -> None: ...


@dataclass(slots=True)
class Family:
    """A scrape-time counter or gauge with all its label sets, as read at one instant."""

    name: str
    kind: Kind
    help: str
    samples: list[tuple[Labels, float]] = field(default_factory=list)

    def add(self, value: float, **labels: str) -> Family:
        self.samples.append((tuple(labels.items()), value))
        return self

    def metric(self) -> Metric:
        """The ``prometheus_client`` family: a counter's samples end in ``_total``, its
        family name does not (the library's OpenMetrics naming; the text format adds it
        back to HELP and TYPE)."""
        if self.kind == "counter":
            base = self.name.removesuffix("_total")
            m = Metric(base, self.help, "counter")
            sample = base + "_total"
        else:
            m = Metric(self.name, self.help, "gauge")
            sample = self.name
        for labels, value in self.samples:
            m.add_sample(sample, dict(labels), value)  # an int stays an int in OTLP
        return m


class _Families(Collector):
    """The ``prometheus_client`` collector of a registry's scrape-time functions."""

    def __init__(self) -> None:
        self.functions: list[Callable[[], Iterable[Family]]] = []

    def collect(self) -> Iterator[Metric]:
        for fn in self.functions:
            for fam in fn():
                yield fam.metric()


M = TypeVar("M", bound=MetricWrapperBase)


class _Bounded(Generic[M]):
    """Maps label values to the library's children, folding values past the bound into
    ``_other``; ``_children`` caches only tuples that were not folded."""

    def __init__(self, metric: M, label_names: Sequence[str], max_values: int) -> None:
        self.metric = metric
        self.label_names = tuple(label_names)
        self.max_values = max_values
        self._seen: list[set[str]] = [set() for _ in self.label_names]
        self._children: dict[tuple[str, ...], M] = {}

    def _key(self, values: tuple[str, ...]) -> tuple[str, ...]:
        if len(values) != len(self.label_names):
            raise ValueError(f"{self.metric} takes labels {self.label_names}, got {values}")
        out = []
        for seen, value in zip(self._seen, values):
            if value not in seen:
                if len(seen) >= self.max_values:
                    value = OTHER
                seen.add(value)
            out.append(value)
        return tuple(out)

    def _child(self, values: tuple[str, ...]) -> M:
        key = self._key(values)
        child = self.metric.labels(*key) if key else self.metric
        if key == values:  # folded tuples are not cached: memory stays bounded
            self._children[values] = child
        return child


class Counter(_Bounded[PromCounter]):
    def inc(self, *labels: str, by: float = 1.0) -> None:
        child = self._children.get(labels)
        if child is None:
            child = self._child(labels)
        child.inc(by)

    def get(self, *labels: str) -> float:
        """The value for ``labels`` (tests and diagnostics: it walks the metric's series)."""
        want = dict(zip(self.label_names, labels))
        for m in self.metric.collect():
            for s in m.samples:
                if s.name.endswith("_total") and s.labels == want:
                    return s.value
        return 0.0


class Histogram(_Bounded[PromHistogram]):
    def child(self, *labels: str) -> Observer:
        """The series for ``labels``; keep it to observe many values (per-token ITL)."""
        child = self._children.get(labels)
        if child is None:
            child = self._child(labels)
        return child

    def observe(self, value: float, *labels: str) -> None:
        child = self._children.get(labels)
        if child is None:
            child = self._child(labels)
        child.observe(value)


class Registry:
    def __init__(self, max_label_values: int = 100) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]  # unannotated upstream
        self.max_label_values = max_label_values
        self.prometheus = CollectorRegistry()
        self._families = _Families()
        self.prometheus.register(self._families)
        self._instruments: list[MetricWrapperBase] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.start_ns = time.time_ns()

    def counter(self, name: str, help_text: str, labels: Sequence[str] = ()) -> Counter:
        """``name`` ends in ``_total`` (the library keeps it on the samples only)."""
        metric = PromCounter(name, help_text, labels, registry=self.prometheus)
        self._instruments.append(metric)
        return Counter(metric, labels, self.max_label_values)

    def histogram(self, name: str, help_text: str, labels: Sequence[str] = (),
                  bounds: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
        metric = PromHistogram(name, help_text, labels, registry=self.prometheus,
                               buckets=tuple(bounds))
        self._instruments.append(metric)
        return Histogram(metric, labels, self.max_label_values)

    def collector(self, fn: Callable[[], Iterable[Family]]) -> None:
        """``fn`` is called at every scrape/export for values read from live state."""
        self._families.functions.append(fn)

    def collect(self) -> list[Metric]:
        """Every family as ``prometheus_client`` metrics, read now, on this thread."""
        return list(self.prometheus.collect())

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop that owns the state the scrape-time families read: a reader on
        another thread (the OTLP pusher) has them read there (``collect_threadsafe``)."""
        self._loop = loop

    def collect_threadsafe(self, timeout_s: float = 5.0) -> list[Metric]:
        """``collect`` from any thread: the scrape-time families are read on the bound
        loop (directly when none is bound, the loop is gone, or this is its thread), the
        library's instruments here. Raises TimeoutError if the loop does not get to it."""
        loop = self._loop
        live: list[Metric]
        if loop is None or loop.is_closed() or not loop.is_running() or _on(loop):
            live = self._live()
        else:
            done: concurrent.futures.Future[list[Metric]] = concurrent.futures.Future()

            def read() -> None:
                try:
                    done.set_result(self._live())
                except Exception as exc:  # noqa: BLE001 - handed to the waiting thread
                    done.set_exception(exc)

            loop.call_soon_threadsafe(read)
            live = done.result(timeout_s)
        return live + [m for metric in self._instruments for m in metric.collect()]

    def _live(self) -> list[Metric]:
        return [fam.metric() for fn in self._families.functions for fam in fn()]

    def render(self) -> str:
        """Prometheus text exposition 0.0.4."""
        return generate_latest(self.prometheus).decode()

    def render_later(self) -> Callable[[], str]:
        """``render`` in two halves: the scrape-time families are read now, on the thread
        that owns the state they read (the event loop); the function returned formats them
        with the library's instruments (thread-safe), and may run on a worker thread, so
        that formatting a large scrape (~250 ms at 100 tenants) does not hold the loop."""
        frozen = _Frozen(self._instruments, self._live())
        return lambda: generate_latest(frozen).decode()  # any object with collect() will do


def _on(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class _Frozen:
    """A registry for one rendering: the instruments, read when it runs, and the
    scrape-time families already read."""

    def __init__(self, instruments: list[MetricWrapperBase], live: list[Metric]) -> None:
        self.instruments = instruments
        self.live = live

    def collect(self) -> Iterator[Metric]:  # in the registry's order: families first
        yield from self.live
        for metric in self.instruments:
            yield from metric.collect()


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
