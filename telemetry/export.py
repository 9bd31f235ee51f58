"""Span export: a bounded queue drained by a background thread, and the transports.

``BatchExporter`` is the batch span processor: ``Span.end()`` appends to a deque (no lock:
``deque.append`` is atomic) and wakes the thread only when a full batch is waiting; the
thread otherwise drains every ``schedule_delay_s``. When the queue is full, spans are
dropped and counted, never blocking a request. A transport failure is logged (at most every
30 s, with the count since the last message) and counted; nothing ever raises into the code
that ended the span.
"""

from __future__ import annotations

import gzip
import http.client
import json
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TextIO
from urllib.parse import urlsplit

from .otlp import Encoder
from .tracing import Span, child_span

log = logging.getLogger("sluice.telemetry")

_LOG_EVERY_S = 30.0
TRACE_SERVICE = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


class Transport(Protocol):
    """``prepare`` runs when a span ends (on the request's thread) and turns it into what the
    queue holds; ``send`` ships a batch of those from the export thread (raises on failure).
    """

    def prepare(self, span: Span) -> Any: ...
    def send(self, items: Sequence[Any]) -> None: ...
    def close(self) -> None: ...


class OtlpHttp:
    """OTLP/HTTP with binary protobuf: one keep-alive connection, reopened after an error."""

    def __init__(self, url: str, resource: Mapping[str, Any], headers: Mapping[str, str],
                 timeout_s: float, compress: bool = False) -> None:
        parts = urlsplit(url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "localhost"
        self._port = parts.port or (443 if self._https else 80)
        self._path = parts.path or "/v1/traces"
        self._headers = {"content-type": "application/x-protobuf", **headers}
        if compress:
            self._headers["content-encoding"] = "gzip"
        self._compress = compress
        self._timeout = timeout_s
        self._conn: http.client.HTTPConnection | None = None
        self.encoder = Encoder(resource)

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=self._timeout)
        return self._conn

    def prepare(self, span: Span) -> tuple[tuple[str, str], bytes, int]:
        return self.encoder.prepare(span)

    def send(self, items: Sequence[tuple[tuple[str, str], bytes, int]]) -> None:
        body = self.encoder.request(items)
        if self._compress:
            body = gzip.compress(body, 1)
        for attempt in (0, 1):  # a kept-alive connection the collector closed: retry once
            conn = self._connection()
            try:
                conn.request("POST", self._path, body, self._headers)
                resp = conn.getresponse()
                resp.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.close()
                if attempt:
                    raise
                continue
            except BaseException:
                self.close()
                raise
            if resp.status >= 300:
                raise RuntimeError(f"the collector answered HTTP {resp.status}")
            return

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class OtlpGrpc:
    """OTLP/gRPC: the encoded request goes out as the raw message bytes."""

    def __init__(self, url: str, resource: Mapping[str, Any], headers: Mapping[str, str],
                 timeout_s: float) -> None:
        import grpc  # type: ignore[import-untyped]  # grpcio ships no type information

        parts = urlsplit(url)
        target = f"{parts.hostname or 'localhost'}:{parts.port or 4317}"
        if parts.scheme == "https":
            self._channel = grpc.secure_channel(target, grpc.ssl_channel_credentials())
        else:
            self._channel = grpc.insecure_channel(target)
        # No (de)serializers: the request is already bytes, the empty response is ignored.
        self._export = self._channel.unary_unary(TRACE_SERVICE)
        self._metadata = tuple((k.lower(), v) for k, v in headers.items())
        self._timeout = timeout_s
        self.encoder = Encoder(resource)

    def prepare(self, span: Span) -> tuple[tuple[str, str], bytes, int]:
        return self.encoder.prepare(span)

    def send(self, items: Sequence[tuple[tuple[str, str], bytes, int]]) -> None:
        self._export(self.encoder.request(items), timeout=self._timeout,
                     metadata=self._metadata or None)

    def close(self) -> None:
        self._channel.close()


class Console:
    """``OTEL_TRACES_EXPORTER=console``: one JSON object per span on a stream (stdout)."""

    def __init__(self, resource: Mapping[str, Any], stream: TextIO | None = None) -> None:
        self._resource = dict(resource)
        self._stream = stream

    def prepare(self, span: Span) -> str:
        spans = [span, *(child_span(span, c) for c in span.children)]
        return "\n".join(json.dumps(span_dict(s, self._resource), default=str) for s in spans)

    def send(self, items: Sequence[str]) -> None:
        stream = self._stream or sys.stdout
        stream.write("".join(line + "\n" for line in items))
        stream.flush()

    def close(self) -> None:
        pass


def span_dict(s: Span, resource: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "name": s.name,
        "trace_id": f"{s.context.trace_id:032x}",
        "span_id": f"{s.context.span_id:016x}",
        "parent_span_id": f"{s.parent_id:016x}" if s.parent_id else None,
        "kind": s.kind_code,
        "start_time_unix_nano": s.start_ns,
        "end_time_unix_nano": s.end_ns,
        "duration_ms": round((s.end_ns - s.start_ns) / 1e6, 3),
        "attributes": s.attributes,
        "events": [{"name": n, "time_unix_nano": t, "attributes": a or {}}
                   for n, t, a in s.events],
        "status": {"code": s.status_code, "message": s.status_message},
        "scope": s.scope[0],
        "resource": resource,
    }


class BatchExporter:
    """The span sink: queue, export thread, drop and failure counters."""

    def __init__(self, transport: Transport, max_queue: int = 8192, max_batch: int = 512,
                 schedule_delay_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.transport = transport
        self.max_queue = max_queue
        self.max_batch = max_batch
        # A transport with its own batching (the shipper) gets spans every 50 ms: its work
        # then comes in small steady slices, not a second's worth in one burst that takes
        # a core away from the serving process for tens of milliseconds.
        self.delay = min(schedule_delay_s, getattr(transport, "handoff_s", schedule_delay_s))
        self._queue: deque[Any] = deque()
        self._wake = threading.Event()
        self._stop = False
        self._flushed = threading.Condition()
        self._flush_seq = 0
        self._clock = clock
        self._sent = 0  # spans the transport took (delivered, unless it reports delivery)
        self.dropped = 0
        self._failed = 0  # spans lost here: encoding errors, hand-over failures
        self._unlogged_failures = 0
        self._last_log = -_LOG_EVERY_S
        self._thread = threading.Thread(target=self._run, name="sluice-span-export",
                                        daemon=True)
        self._thread.start()

    def __call__(self, span: Span) -> None:
        """Called by ``Span.end()`` on the request's thread; never raises.

        The transport's ``prepare`` runs here, not on the export thread: the queue then
        holds bytes (encoded OTLP, or a marshal'd record for the shipper), which the garbage
        collector does not track. Queued span objects (dicts, lists) live long enough to
        reach the oldest generation and make full collections frequent and long: tens of
        milliseconds of pause at a few hundred requests a second.
        """
        q = self._queue
        if len(q) >= self.max_queue:
            self.dropped += 1 + len(span.children)
            return
        try:
            q.append((1 + len(span.children), self.transport.prepare(span)))
        except Exception:  # a bad attribute value must not fail the request
            self._failed += 1 + len(span.children)
            log.debug("encoding span %r failed", span.name, exc_info=True)
            return
        if len(q) == self.max_batch:
            self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.delay)
            self._wake.clear()
            self._drain()
            with self._flushed:
                self._flush_seq += 1
                self._flushed.notify_all()
            if self._stop:
                return

    def _drain(self) -> None:
        q = self._queue
        while q:
            batch: list[Any] = []
            spans = 0
            while q and spans < self.max_batch:
                n, item = q.popleft()
                batch.append(item)
                spans += n
            try:
                self.transport.send(batch)
                self._sent += spans
            except Exception as exc:  # noqa: BLE001 - telemetry never breaks serving
                self._failed += spans
                self._log_failure(exc, spans)

    @property
    def exported(self) -> int:
        """Spans delivered to the collector (as far as the transport can tell)."""
        if getattr(self.transport, "reports_delivery", False):
            return int(getattr(self.transport, "exported", 0))  # not part of Transport
        return self._sent

    @property
    def failed(self) -> int:
        """Spans lost to errors: here, or in the transport's own process."""
        return self._failed + int(getattr(self.transport, "failed", 0))

    def _log_failure(self, exc: Exception, n: int) -> None:
        self._unlogged_failures += n
        now = self._clock()
        if now - self._last_log >= _LOG_EVERY_S:
            log.warning("span export failed (%d spans dropped since the last message): %s: %s",
                        self._unlogged_failures, type(exc).__name__, exc)
            self._unlogged_failures = 0
            self._last_log = now

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """Export everything queued so far; True when done within the timeout."""
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive():
            # A pass drains until the queue is empty, so once one more pass has ended and
            # the queue is empty, everything queued before this call has been sent.
            with self._flushed:
                start = self._flush_seq
                self._wake.set()

                def passed(s: int = start) -> bool:  # a default binds start (ruff B023)
                    return self._flush_seq > s

                if not self._flushed.wait_for(passed, max(0.0, deadline - time.monotonic())):
                    return False
            if not self._queue:
                return self._flush_transport(max(0.0, deadline - time.monotonic()))
        return not self._queue

    def _flush_transport(self, timeout_s: float) -> bool:
        flush = getattr(self.transport, "flush", None)
        return bool(flush(timeout_s)) if flush is not None else True

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout_s)
        try:
            self.transport.close()  # the shipper sends what it holds, then exits
        except Exception:
            log.debug("closing the span transport failed", exc_info=True)
