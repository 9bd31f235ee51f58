"""The span shipper: records cross the pipe intact, spans arrive, a dead shipper is
replaced, closing delivers what was held; and the in-process path still works."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
from opentelemetry import trace

from telemetry import Telemetry, record_phase
from telemetry import shipper as shipper_mod
from telemetry.bench.otlp_sink import OtlpReceiver
from telemetry.otlp import Encoder, to_record
from telemetry.shipper import ShipperTransport
from telemetry.tracing import Sampler, Span, TracerProvider

RESOURCE = {"service.name": "test"}


@pytest.fixture
def rx() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


def finished_tree() -> Span:
    ended: list[Span] = []
    tracer = TracerProvider(Sampler("always_on"), ended.append).get_tracer("scope", "1.2")
    root = tracer.start_span("root", kind=trace.SpanKind.SERVER,
                             attributes={"s": "x", "i": -3, "f": 0.5, "b": True,
                                         "l": ["a", "b"]})
    root.add_event("evt", {"k": 1})
    root.set_status(trace.StatusCode.ERROR, "broken")
    record_phase(tracer, root, "child", 10, 20, {"c": 2})
    root.end()
    assert isinstance(ended[0], Span)
    return ended[0]


def settings(rx: OtlpReceiver, **extra: object) -> dict[str, object]:
    return {"protocol": "http/protobuf", "url": rx.endpoint + "/v1/traces",
            "resource": RESOURCE, "headers": {}, "timeout_s": 2.0, "max_batch": 512,
            "delay_s": 0.05, **extra}


def test_a_record_encodes_exactly_like_the_span() -> None:
    import marshal

    span = finished_tree()
    enc = Encoder(RESOURCE)
    record = marshal.loads(marshal.dumps(to_record(span)))
    assert Encoder(RESOURCE).prepare_record(record) == enc.prepare(span)


@pytest.mark.parametrize("native", [True, False], ids=["c-encoded-here", "record-to-shipper"])
def test_spans_cross_to_the_collector_and_are_counted(rx: OtlpReceiver, native: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import marshal

    from telemetry import otlp

    if native and otlp._native is None:
        pytest.skip("telemetry._otlp was not built")
    monkeypatch.setattr(otlp, "NATIVE", native)
    t = ShipperTransport(settings(rx))
    # what crosses the pipe: the encoded spans with the C encoder, else the span tree
    frame = marshal.loads(t.prepare(finished_tree())[4:])
    assert len(frame) == (3 if native else 17)
    try:
        t.send([t.prepare(finished_tree()) for _ in range(3)])
        assert t.flush(10)
        spans = rx.wait_for(lambda s: len(s) == 6)
        assert sorted(s.name for s in spans) == ["child"] * 3 + ["root"] * 3
        root = next(s for s in spans if s.name == "root")
        assert root.attributes == {"s": "x", "i": -3, "f": 0.5, "b": True, "l": ["a", "b"]}
        assert root.status_message == "broken" and root.resource["service.name"] == "test"
        assert t.exported == 6 and t.failed == 0
    finally:
        t.close()


def test_closing_delivers_what_the_shipper_holds(rx: OtlpReceiver) -> None:
    t = ShipperTransport(settings(rx, delay_s=60.0))  # it would hold them for a minute
    t.send([t.prepare(finished_tree())])
    t.close()
    assert len(rx.wait_for(lambda s: len(s) == 2, timeout=5)) == 2


def test_a_dead_shipper_is_replaced(rx: OtlpReceiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shipper_mod, "_RESTART_EVERY_S", 0.0)
    t = ShipperTransport(settings(rx))
    try:
        proc = t._proc
        assert proc is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)
        t.send([t.prepare(finished_tree())])  # finds it dead, starts another
        assert t._proc is not proc and t.flush(10)
        assert len(rx.wait_for(lambda s: len(s) == 2)) == 2
    finally:
        t.close()


def test_a_collector_refusing_is_counted_as_failed(rx: OtlpReceiver) -> None:
    rx.status = 400
    t = ShipperTransport(settings(rx))
    try:
        t.send([t.prepare(finished_tree())])
        assert t.flush(10)
        deadline = time.monotonic() + 5
        while t.failed < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert t.failed == 2 and t.exported == 0
    finally:
        t.close()


@pytest.mark.parametrize("export_process", ["true", "false"])
def test_both_export_paths_deliver(rx: OtlpReceiver, export_process: str) -> None:
    from telemetry.config import TelemetryConfig, TracesConfig

    cfg = TelemetryConfig(traces=TracesConfig(exporter="otlp", endpoint=rx.endpoint,
                                              export_process=export_process == "true"))
    tel = Telemetry.create("svc", cfg, env={"OTEL_BSP_SCHEDULE_DELAY": "50"})
    try:
        assert isinstance(tel.spans.transport, ShipperTransport) == (export_process == "true")
        span = tel.tracer.start_span("one")
        span.end()
        assert tel.force_flush(10)
        assert [s.name for s in rx.wait_for(lambda s: len(s) == 1)] == ["one"]
        assert tel.spans.exported == 1
    finally:
        tel.shutdown()
