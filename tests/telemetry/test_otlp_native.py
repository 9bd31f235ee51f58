"""The C span encoder (telemetry/_otlp.c) against the pure-Python one: the same bytes for
every record, whatever its attributes, events, links, status and children hold."""

from __future__ import annotations

import marshal
import os
from collections import OrderedDict
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from telemetry import otlp
from telemetry.otlp import Encoder

pytestmark = pytest.mark.skipif(
    otlp._native is None and not os.environ.get("SLUICE_REQUIRE_NATIVE"),
    reason="telemetry._otlp was not built (no C compiler at install time)")


def test_the_accelerator_is_built_where_ci_requires_it() -> None:
    # .ci/run sets SLUICE_REQUIRE_NATIVE=1: there the module must exist and be on
    assert otlp._native is not None, "telemetry/_otlp.c was not built"
    assert otlp.NATIVE and Encoder({}).native
    assert not Encoder({}, native=False).native


class Opaque:
    def __str__(self) -> str:
        return "opaque ✓"


keys = st.text(min_size=0, max_size=12)
scalars = st.one_of(
    st.text(max_size=20),  # includes lone surrogates: encoded with replacement
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),  # int64 two's complement, masked
    st.floats(allow_nan=True, allow_infinity=True),
    st.binary(max_size=20),
    st.builds(bytearray, st.binary(max_size=8)),
    st.just(None),
    st.just(Opaque()),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner),
                            st.dictionaries(st.one_of(keys, st.integers()), inner, max_size=3)),
    max_leaves=8)
attributes = st.dictionaries(keys, values, max_size=6)
u64 = st.integers(min_value=0, max_value=2**64 - 1)
ids64 = st.integers(min_value=1, max_value=2**64 - 1)
children = st.lists(st.tuples(st.text(max_size=10), ids64, u64, u64,
                              st.one_of(st.none(), attributes), st.integers(0, 5)), max_size=4)
records = st.tuples(
    st.just(("scope", "1.0")), st.integers(min_value=1, max_value=2**128 - 1), ids64,
    st.integers(0, 255), st.one_of(st.just(""), st.text(max_size=12)),
    st.one_of(st.just(0), ids64), st.booleans(), st.text(max_size=16), st.integers(0, 5),
    u64, u64, attributes,
    st.lists(st.tuples(st.text(max_size=8), u64, st.one_of(st.none(), attributes)),
             max_size=3),
    st.lists(st.tuples(st.integers(min_value=1, max_value=2**128 - 1), ids64,
                       st.one_of(st.none(), attributes)), max_size=2),
    st.integers(0, 2), st.text(max_size=12), children)


@settings(max_examples=300, deadline=None)
@given(records)
def test_c_and_python_encoders_write_the_same_bytes(r: tuple[Any, ...]) -> None:
    native, python = Encoder({}, native=True), Encoder({}, native=False)
    want = python.record(r)
    assert native.record(r) == want
    assert python.record(r) == want  # the Python encoder's caches change nothing either
    # what the shipper gets: the record after marshal (version 2, as ShipperTransport sends)
    plain = _marshal_safe(r)
    if plain is not None:
        assert native.record(marshal.loads(marshal.dumps(plain, 2))) == python.record(plain)


def _marshal_safe(value: Any) -> Any:
    """The record without the objects marshal refuses (Opaque), or None."""
    try:
        marshal.dumps(value)
    except ValueError:
        return None
    return value


def test_a_real_span_tree_decodes_the_same_either_way() -> None:
    from telemetry.otlp import to_record
    from telemetry.tracing import Sampler, TracerProvider, record_phase

    spans: list[Any] = []
    tracer = TracerProvider(Sampler("always_on"), spans.append, seed=3).get_tracer("t", "2")
    root = tracer.start_span("sluice.request", attributes={"tenant": "acme", "n": 3})
    record_phase(tracer, root, "sluice.queue.wait", 10, 20, {"q": 0.5})
    root.add_event("first", {"ms": 1.5})
    root.end()
    r = to_record(spans[0])
    native, python = Encoder({"service.name": "x"}, native=True), \
        Encoder({"service.name": "x"}, native=False)
    assert native.record(r) == python.record(r)
    body = native.request([native.prepare_record(r)])
    spans_out = ExportTraceServiceRequest.FromString(body).resource_spans[0].scope_spans[0].spans
    assert [s.name for s in spans_out] == ["sluice.request", "sluice.queue.wait"]


def test_shapes_the_c_encoder_does_not_take_go_to_the_python_one() -> None:
    r = list(_record(attrs=OrderedDict(a=1)))
    r[11] = _Mapping({"a": 1, "b": "x"})  # a Mapping that is not a dict
    native, python = Encoder({}, native=True), Encoder({}, native=False)
    assert native.record(tuple(r)) == python.record(tuple(r))


@pytest.mark.parametrize("field, value", [(1, -1), (1, 2**128), (2, 2**64), (9, -5)])
def test_out_of_range_ids_and_times_raise_in_both(field: int, value: int) -> None:
    r = list(_record())
    r[field] = value
    for native in (True, False):
        with pytest.raises((OverflowError, ValueError, Exception)):
            Encoder({}, native=native).record(tuple(r))


class _Mapping:
    """A read-only Mapping that is not a dict."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._d = data

    def items(self) -> Any:
        return self._d.items()

    def __bool__(self) -> bool:
        return bool(self._d)


def _record(attrs: Any = None) -> tuple[Any, ...]:
    return (("s", ""), 0xABC, 0xDEF, 1, "", 0, False, "n", 1, 100, 200,
            attrs if attrs is not None else {"k": "v"}, [], [], 0, "", [])


def test_the_encoder_cost_bench_runs_and_checks_both_encoders(
        capsys: pytest.CaptureFixture[str]) -> None:
    import gc

    from telemetry.bench import encoder_cost

    try:
        assert encoder_cost.main(["--requests", "40"]) == 0
    finally:
        gc.unfreeze()
    out = capsys.readouterr().out
    assert "encode, python (shipper)" in out and "encode, c (shipper)" in out
    assert "(same bytes: yes)" in out
