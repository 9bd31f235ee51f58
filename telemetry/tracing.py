"""A lean implementation of the OpenTelemetry tracing API.

Everything outside ``telemetry/`` codes against ``opentelemetry.trace`` (the API); this
module is the implementation behind it. It keeps the SDK's semantics (W3C ids, the six
standard samplers, parent-based sampling, resource, instrumentation scope, batch export on a
background thread) at a fraction of its cost: the stock SDK spends ~20 µs creating and
ending a span and ~70 µs encoding it, and a gateway request makes seven of them while the
whole request costs well under a millisecond. Here a span is a slotted object whose
``end()`` appends it to a deque; encoding happens on the export thread (``otlp.Encoder``).

Spans are meant for one thread at a time (an asyncio task, or the engine's finish path);
the export queue is the only shared structure and ``deque.append`` is atomic.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from itertools import islice
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context, get_current
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation import _SPAN_KEY, set_span_in_context
from opentelemetry.util import types

log = logging.getLogger("sluice.telemetry")

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSAMPLED = TraceFlags(TraceFlags.DEFAULT)
_MAX_ATTRIBUTES = 128
_MAX_EVENTS = 128
_KIND_CODE = {k: k.value + 1 for k in SpanKind}  # the API's INTERNAL=0 is the proto's 1
_INTERNAL, _CLIENT, _SERVER = SpanKind.INTERNAL, SpanKind.CLIENT, SpanKind.SERVER
_STATUS_CODE = {StatusCode.UNSET: 0, StatusCode.OK: 1, StatusCode.ERROR: 2}


class Sampler:
    """The spec's standard samplers, by their ``OTEL_TRACES_SAMPLER`` name."""

    __slots__ = ("_bound", "name", "parent_based", "root")

    def __init__(self, name: str, arg: float | None = None) -> None:
        self.name = name
        self.parent_based = name.startswith("parentbased_")
        root = name.removeprefix("parentbased_")
        self.root = root  # always_on | always_off | traceidratio
        rate = 1.0 if arg is None else arg
        # As the SDK: sampled when the trace id's low 64 bits are below rate × 2^64.
        self._bound = round(rate * (1 << 64)) if root == "traceidratio" else 0

    def sample(self, parent: SpanContext | None, trace_id: int) -> bool:
        if self.parent_based and parent is not None and parent.is_valid:
            return parent.trace_flags.sampled
        if self.root == "always_on":
            return True
        if self.root == "always_off":
            return False
        return (trace_id & 0xFFFFFFFFFFFFFFFF) < self._bound

    def __repr__(self) -> str:
        return f"Sampler({self.name!r})"


class Span(trace.Span):
    """A recording span; ``end()`` hands it to the provider's export queue."""

    __slots__ = ("_sink", "attributes", "children", "context", "end_ns", "events", "kind_code",
                 "links", "name", "parent_id", "parent_remote", "scope", "start_ns",
                 "status_code", "status_message")

    def __init__(self, sink: Any, scope: tuple[str, str], name: str, context: SpanContext,
                 parent: SpanContext | None, kind: SpanKind, attributes: types.Attributes,
                 links: Sequence[Link], start_ns: int) -> None:
        self._sink = sink
        self.scope = scope
        self.name = name
        self.context = context
        if parent is None:
            self.parent_id = 0
            self.parent_remote = False
        else:
            self.parent_id = parent[1]  # span_id (SpanContext is a tuple)
            self.parent_remote = parent[2]  # is_remote
        # identity tests first: hashing an enum member runs Python code
        self.kind_code = (2 if kind is _SERVER else 1 if kind is _INTERNAL
                          else 3 if kind is _CLIENT else _KIND_CODE[kind])
        self.attributes: dict[str, Any] = dict(attributes) if attributes else {}
        if len(self.attributes) > _MAX_ATTRIBUTES:  # the limit holds from the start too
            self.attributes = dict(islice(self.attributes.items(), _MAX_ATTRIBUTES))
        self.links = links
        self.events: list[tuple[str, int, Mapping[str, Any] | None]] = []
        self.start_ns = start_ns
        self.end_ns = 0
        self.status_code = 0
        self.status_message = ""
        self.children: list[ChildRecord] = []

    def add_child(self, child: ChildRecord) -> None:
        """A finished child span, exported together with this one (see ``ChildRecord``)."""
        if self.end_ns == 0:
            self.children.append(child)
        else:  # the parent is gone: the child goes on its own
            self._sink(child_span(self, child))

    # ---- the API ---------------------------------------------------------------------------
    def get_span_context(self) -> SpanContext:
        return self.context

    def is_recording(self) -> bool:
        return self.end_ns == 0

    def set_attribute(self, key: str, value: types.AnyValue) -> None:
        if self.end_ns == 0 and value is not None and (
                len(self.attributes) < _MAX_ATTRIBUTES or key in self.attributes):
            self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, types.AnyValue]) -> None:
        if self.end_ns:
            return
        mine = self.attributes
        if len(mine) + len(attributes) <= _MAX_ATTRIBUTES:
            mine.update(attributes)
            return
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def add_event(self, name: str, attributes: types.Attributes = None,
                  timestamp: int | None = None) -> None:
        if self.end_ns == 0 and len(self.events) < _MAX_EVENTS:
            self.events.append((name, timestamp or time.time_ns(),
                                dict(attributes) if attributes else None))

    def add_link(self, context: SpanContext, attributes: types.Attributes = None) -> None:
        if self.end_ns == 0 and context.is_valid:
            self.links = [*self.links, Link(context, attributes)]

    def update_name(self, name: str) -> None:
        if self.end_ns == 0:
            self.name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if self.end_ns:
            return
        if isinstance(status, Status):
            code, description = status.status_code, status.description
        else:
            code = status
        if self.status_code == 1 or code is StatusCode.UNSET:  # OK is final; UNSET ignored
            return
        self.status_code = _STATUS_CODE[code]
        self.status_message = (description or "") if code is StatusCode.ERROR else ""

    def record_exception(self, exception: BaseException, attributes: types.Attributes = None,
                         timestamp: int | None = None, escaped: bool = False) -> None:
        attrs: dict[str, Any] = {"exception.type": type(exception).__qualname__,
                                 "exception.message": str(exception)}
        if attributes:
            attrs.update(attributes)
        self.add_event("exception", attrs, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self.end_ns:
            return
        self.end_ns = end_time or time.time_ns()
        self._sink(self)

    def __repr__(self) -> str:
        return (f"Span({self.name!r}, trace={self.context.trace_id:032x}, "
                f"span={self.context.span_id:016x})")


# A finished phase of a request, recorded as a child span of a ``Span`` without going
# through the tracer: a plain tuple (name, span_id, start_ns, end_ns, attributes, kind_code)
# in the parent's ``children``, exported with the parent in the same batch. Plain tuples
# because they go to the shipper as they are (``marshal`` takes no objects).
ChildRecord = tuple[str, int, int, int, "dict[str, Any] | None", int]


def child_span(parent: Span, child: ChildRecord) -> Span:
    """A batched child as a ``Span`` of its own (console export, a child that outlived its
    parent)."""
    name, span_id, start_ns, end_ns, attributes, kind_code = child
    ctx = SpanContext(parent.context.trace_id, span_id, False, _SAMPLED,
                      parent.context.trace_state)
    span = Span(parent._sink, parent.scope, name, ctx, parent.context,
                SpanKind(kind_code - 1), attributes, (), start_ns)
    span.end_ns = end_ns
    return span


class Tracer(trace.Tracer):
    __slots__ = ("_provider", "_scope")

    def __init__(self, provider: TracerProvider, scope: tuple[str, str]) -> None:
        self._provider = provider
        self._scope = scope

    def start_span(self, name: str, context: Context | None = None,
                   kind: SpanKind = SpanKind.INTERNAL, attributes: types.Attributes = None,
                   links: trace._Links = None, start_time: int | None = None,
                   record_exception: bool = True,
                   set_status_on_exception: bool = True) -> trace.Span:
        current: trace.Span | None = (get_current() if context is None
                                      else context).get(_SPAN_KEY)  # type: ignore[assignment]  # Context values are object; this one is a Span (hot path: no cast)
        parent: SpanContext | None = None
        if current is not None:
            parent = current.get_span_context()
            if not parent.is_valid:
                parent = None
        p = self._provider
        rng = p.rng
        if parent is None:
            trace_id = rng.getrandbits(128) or 1
            state = None
        else:
            trace_id, state = parent[0], parent[4]  # SpanContext is a tuple; its
            # properties are Python-level getters
        span_id = rng.getrandbits(64) or 1
        if not p.sampler.sample(parent, trace_id):
            return trace.NonRecordingSpan(SpanContext(trace_id, span_id, False, _UNSAMPLED,
                                                      state))
        ctx = SpanContext(trace_id, span_id, False, _SAMPLED, state)
        return Span(p.sink, self._scope, name, ctx, parent, kind, attributes,
                    list(links) if links else (), start_time or time.time_ns())


    @contextmanager
    def start_as_current_span(self, name: str, context: Context | None = None,  # type: ignore[override]  # the base returns otel's private subclass of contextlib's manager
                              kind: SpanKind = SpanKind.INTERNAL,
                              attributes: types.Attributes = None,
                              links: trace._Links = None, start_time: int | None = None,
                              record_exception: bool = True,
                              set_status_on_exception: bool = True,
                              end_on_exit: bool = True) -> Iterator[trace.Span]:
        span = self.start_span(name, context, kind, attributes, links, start_time)
        with trace.use_span(span, end_on_exit=end_on_exit,
                            record_exception=record_exception,
                            set_status_on_exception=set_status_on_exception) as s:
            yield s


class TracerProvider(trace.TracerProvider):
    """Hands out tracers; ``sink`` receives every ended recording span."""

    def __init__(self, sampler: Sampler, sink: Any, seed: int | None = None) -> None:
        self.sampler = sampler
        self.sink = sink
        self.rng = random.Random(seed)  # ids: not security tokens, like the SDK's

    def get_tracer(self, instrumenting_module_name: str,
                   instrumenting_library_version: str | None = None,
                   schema_url: str | None = None,
                   attributes: types.Attributes = None) -> Tracer:
        return Tracer(self, (instrumenting_module_name, instrumenting_library_version or ""))


_getrandbits = random.getrandbits


def new_span_id() -> int:
    return _getrandbits(64) or 1


def record_phase(tracer: trace.Tracer, parent: trace.Span, name: str, start_ns: int,
                 end_ns: int, attributes: dict[str, Any] | None = None,
                 kind: SpanKind = SpanKind.INTERNAL, span_id: int = 0) -> None:
    """A finished child span of ``parent`` from its two timestamps: batched with the parent
    (a ``ChildRecord``) when the parent is ours, through the tracer for any other
    implementation."""
    if type(parent) is Span:
        # identity tests first: hashing an enum member runs Python code
        child = (name, span_id or _getrandbits(64) or 1, start_ns, end_ns, attributes,
                 1 if kind is _INTERNAL else 3 if kind is _CLIENT else _KIND_CODE[kind])
        if parent.end_ns == 0:
            parent.children.append(child)
        else:
            parent.add_child(child)
    elif parent.is_recording():
        span = tracer.start_span(name, set_span_in_context(parent), kind, attributes,
                                 start_time=start_ns)
        span.end(end_ns)
