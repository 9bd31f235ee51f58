"""Tools that measure what telemetry costs, and the OTLP receiver that tests and benches
check exports against. Run as ``python -m telemetry.bench.<tool>``; none of them is
imported by serving code.

* ``otlp_sink``: an in-process OTLP/HTTP and OTLP/gRPC receiver (tests, the tracing bench).
* ``encoder_cost``: what encoding one gateway request's trace costs, C against Python.
"""
