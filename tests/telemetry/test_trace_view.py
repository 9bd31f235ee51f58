"""The trace layout of ``python -m telemetry.bench.trace_view`` (docs/observability.md)."""

from __future__ import annotations

from telemetry.bench.otlp_sink import ReceivedEvent, ReceivedSpan
from telemetry.bench.trace_view import render

MS = 1_000_000


def span(name: str, sid: str, parent: str | None, start: int, end: int, service: str,
         kind: int = 1, events: list[ReceivedEvent] | None = None) -> ReceivedSpan:
    return ReceivedSpan("ab" * 16, sid, parent, name, kind, start * MS, end * MS, {},
                        events or [], 0, "", {"service.name": service}, "s")


def test_a_trace_is_a_tree_in_start_order_with_offsets_durations_and_events() -> None:
    t0 = 1_700_000_000_000
    spans = [  # out of order, as a collector may receive them
        span("engine.decode", "05", "04", t0 + 20, t0 + 30, "backend"),
        span("chat m", "04", "03", t0 + 5, t0 + 31, "backend", kind=2),
        span("sluice.upstream", "03", "01", t0 + 4, t0 + 32, "gateway", kind=3),
        span("sluice.admission.reserve", "02", "01", t0 + 1, t0 + 2, "gateway"),
        span("chat m", "01", "99", t0, t0 + 40, "gateway", kind=2,  # a remote parent
             events=[ReceivedEvent("gen_ai.first_token", (t0 + 21) * MS, {"x": 1})]),
    ]
    lines = render(spans).splitlines()
    assert lines[0] == f"trace {'ab' * 16}: 5 spans, 40.00 ms"
    names = [ln.lstrip(" │├└─").split("  ")[0] for ln in lines[2:]]
    assert names == ["chat m", "· gen_ai.first_token @ 21.00 ms {'x': 1}",
                     "sluice.admission.reserve", "sluice.upstream", "chat m", "engine.decode"]
    upstream = next(ln for ln in lines if "sluice.upstream" in ln)
    assert upstream.startswith("└─ sluice.upstream") and "CLIENT" in upstream
    assert "    4.00" in upstream and "   28.00" in upstream  # start offset, duration
    decode = next(ln for ln in lines if "engine.decode" in ln)
    assert decode.startswith("      └─ engine.decode") and "backend" in decode


def test_no_spans() -> None:
    assert render([]) == "(no spans)"
