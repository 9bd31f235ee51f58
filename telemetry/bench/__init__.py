"""Tools that measure what telemetry costs, and the OTLP receiver that tests and benches
check exports against. Run as ``python -m telemetry.bench.<tool>``; none of them is
imported by serving code.

* ``otlp_sink``: an in-process OTLP/HTTP and OTLP/gRPC receiver (tests, the tracing bench).
* ``metrics_cost``: per-request metric recording and one scrape, prometheus_client against
  the OpenTelemetry SDK's metrics.
* ``trace_view``: one request's trace through ``sluice up``, laid out as a tracing UI shows it.
"""
