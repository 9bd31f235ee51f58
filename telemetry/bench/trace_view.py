"""One request's trace as a tracing UI lays it out: the span tree with each span's service,
kind, start offset and duration, a timeline bar, and its events.

    python -m telemetry.bench.trace_view [--prompt TEXT] [--max-tokens N]

Starts a test OTLP/HTTP receiver (``telemetry.bench.otlp_sink``) and ``sluice up`` exporting
every span to it (``OTEL_TRACES_EXPORTER=otlp``, the same OTLP the Compose stack sends to
Jaeger), sends one streamed chat completion with the demo key, and prints the request's
trace: what Jaeger's trace view shows for it (docs/observability.md). ``render`` does the
layout for any list of received spans.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from .otlp_sink import OtlpReceiver, ReceivedSpan

KINDS = {1: "", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
BAR = 24


def render(spans: list[ReceivedSpan], events: bool = True) -> str:
    """The spans of one trace as an indented tree, children in start order."""
    if not spans:
        return "(no spans)"
    ids = {s.span_id for s in spans}
    children: dict[str | None, list[ReceivedSpan]] = {}
    for s in spans:
        parent = s.parent_span_id if s.parent_span_id in ids else None
        children.setdefault(parent, []).append(s)
    for group in children.values():
        group.sort(key=lambda s: (s.start_ns, s.name))
    t0 = min(s.start_ns for s in spans)
    total = max(1, max(s.end_ns for s in spans) - t0)
    lines = [f"trace {spans[0].trace_id}: {len(spans)} spans, {total / 1e6:.2f} ms",
             f"{'span':<44}{'service':<16}{'kind':<8}{'start ms':>9}{'ms':>9}  timeline"]

    def walk(span: ReceivedSpan, prefix: str, last: bool, depth: int) -> None:
        branch = "" if depth == 0 else ("└─ " if last else "├─ ")
        label = (prefix + branch + span.name)[:43]
        start = (span.start_ns - t0) / 1e6
        dur = (span.end_ns - span.start_ns) / 1e6
        a = int((span.start_ns - t0) / total * BAR)
        b = max(a + 1, int((span.end_ns - t0) / total * BAR))
        bar = " " * a + "█" * (b - a)
        service = str(span.resource.get("service.name", "?"))
        lines.append(f"{label:<44}{service:<16}{KINDS.get(span.kind, ''):<8}"
                     f"{start:>9.2f}{dur:>9.2f}  |{bar:<{BAR}}|")
        inner = prefix + ("" if depth == 0 else ("   " if last else "│  "))
        if events:
            for e in span.events:
                lines.append(f"{inner}   · {e.name} @ {(e.time_ns - t0) / 1e6:.2f} ms"
                             + (f" {e.attributes}" if e.attributes else ""))
        kids = children.get(span.span_id, [])
        for i, kid in enumerate(kids):
            walk(kid, inner, i == len(kids) - 1, depth + 1)

    for root in children.get(None, []):
        walk(root, "", True, 0)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m telemetry.bench.trace_view",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", default="Say hello to the gateway.")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    import httpx

    from loadtest import targets as procs

    with OtlpReceiver() as rx, tempfile.TemporaryDirectory() as tmp:
        port = procs.free_port()
        env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
               "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_TRACES_SAMPLER": "parentbased_always_on"}
        up = procs._spawn("sluice-up", [sys.executable, "-m", "sluice.cli", "up", "--port",
                                        str(port), "--backend-port", str(procs.free_port()),
                                        "--log-level", "warning"], port, Path(tmp), env=env)
        try:
            procs.wait_ready(up, "/readyz", 180)
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                           headers={"authorization": "Bearer sk-demo-alpha",
                                    "x-request-id": "trace-view"},
                           json={"model": "sluice-tiny", "stream": True,
                                 "max_tokens": args.max_tokens,
                                 "messages": [{"role": "user", "content": args.prompt}]})
            r.raise_for_status()

            def done(spans: list[ReceivedSpan]) -> bool:
                mine = [s for s in spans if s.attributes.get("sluice.request.id") ==
                        "trace-view" and s.kind == 2]
                return len({s.resource.get("service.name") for s in mine}) == 2

            spans = rx.wait_for(done, timeout=30)
            trace_id = next(s.trace_id for s in spans
                            if s.attributes.get("sluice.request.id") == "trace-view")
            print(render([s for s in spans if s.trace_id == trace_id]))
        finally:
            up.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
