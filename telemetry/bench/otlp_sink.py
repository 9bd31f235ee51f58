"""A test-only OTLP receiver, so tests and the bench can check what Sluice really exports.

A Collector in CI only to assert on a span's attributes would be slow and flaky; this stands
in for it. OTLP/HTTP runs its own event loop in a daemon thread, so sync and async tests both
use it without sharing their loop; OTLP/gRPC runs on grpcio's server. Both flatten exports
into frozen records that tests compare with `==`, or with `decode=False` only count requests
and bytes (a cheap sink for the benchmark). Manual use next to `sluice up`:
`python -m telemetry.bench.otlp_sink [--port P] [--no-decode] [--grpc]`.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import signal
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Self, TypeVar

import grpc  # type: ignore[import-untyped]  # grpcio ships no type information
from google.protobuf.message import (  # type: ignore[import-untyped]  # nor does protobuf
    DecodeError,
    Message,
)
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as msvc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as msvc_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tsvc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tsvc_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

MAX_BODY_BYTES = 64 * 1024 * 1024
# path -> (kind, request class, serialized empty response): OTLP/HTTP answers 200 with an
# empty Export*ServiceResponse, which clients read as "nothing rejected".
_ROUTES: dict[str, tuple[str, type[Message], bytes]] = {
    "/v1/traces": ("traces", tsvc.ExportTraceServiceRequest,
                   tsvc.ExportTraceServiceResponse().SerializeToString()),
    "/v1/metrics": ("metrics", msvc.ExportMetricsServiceRequest,
                    msvc.ExportMetricsServiceResponse().SerializeToString()),
}
_DECODERS: dict[str, Callable[[bytes], bytes]] = {"gzip": gzip.decompress,
                                                  "deflate": zlib.decompress}
_REASONS = {s.value: s.phrase for s in HTTPStatus}
# How a failure `status` set on a receiver reads over gRPC (exporters retry on some codes).
_GRPC_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
               503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class ReceivedEvent:
    """One span event; `attributes` decoded as for `ReceivedSpan`."""

    name: str
    time_ns: int
    attributes: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    """One exported span, flattened with its resource and scope so a test needs no proto.
    Attribute values: str/bool/int/float/bytes, list for arrays, dict for kvlists."""

    trace_id: str  # 32 hex chars
    span_id: str  # 16 hex chars
    parent_span_id: str | None  # 16 hex chars; None for a root span
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind value
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[ReceivedEvent]
    status_code: int  # Status.StatusCode: 0 unset, 1 ok, 2 error
    status_message: str
    resource: dict[str, Any]
    scope: str
    flags: int = 0


@dataclass(frozen=True, slots=True)
class ReceivedMetric:
    """One exported metric. Each point is a dict with `attributes` and `time_ns`, plus
    `value` (sum, gauge) or `count`, `sum`, `bucket_counts`, `explicit_bounds` (histogram);
    exponential histograms and summaries get `count` and `sum` only."""

    name: str
    kind: str  # "sum", "gauge", "histogram", "exponential_histogram", "summary"
    points: list[dict[str, Any]]
    resource: dict[str, Any]
    scope: str = ""
    unit: str = ""
    is_monotonic: bool | None = None  # sums only


def _any_value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_any_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return _attributes(v.kvlist_value.values)
    return None if which is None else getattr(v, which)


def _attributes(kvs: Iterable[KeyValue]) -> dict[str, Any]:
    return {kv.key: _any_value(kv.value) for kv in kvs}


def _flatten_spans(req: Any) -> list[ReceivedSpan]:
    return [ReceivedSpan(
        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
        parent_span_id=s.parent_span_id.hex() or None, name=s.name, kind=s.kind,
        start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
        attributes=_attributes(s.attributes),
        events=[ReceivedEvent(e.name, e.time_unix_nano, _attributes(e.attributes))
                for e in s.events],
        status_code=s.status.code, status_message=s.status.message,
        resource=_attributes(rs.resource.attributes), scope=ss.scope.name, flags=s.flags)
        for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]


def _point(kind: str, p: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"attributes": _attributes(p.attributes), "time_ns": p.time_unix_nano}
    if kind in ("sum", "gauge"):
        d["value"] = getattr(p, p.WhichOneof("value") or "as_int")
    elif kind == "histogram":
        d.update(count=p.count, sum=p.sum, bucket_counts=list(p.bucket_counts),
                 explicit_bounds=list(p.explicit_bounds))
    else:
        d.update(count=p.count, sum=p.sum)
    return d


def _flatten_metrics(req: Any) -> list[ReceivedMetric]:
    out: list[ReceivedMetric] = []
    for rm in req.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if (kind := m.WhichOneof("data")) is None:
                    continue
                data = getattr(m, kind)
                out.append(ReceivedMetric(
                    name=m.name, kind=kind, points=[_point(kind, p) for p in data.data_points],
                    resource=_attributes(rm.resource.attributes), scope=sm.scope.name,
                    unit=m.unit, is_monotonic=data.is_monotonic if kind == "sum" else None))
    return out


class _ReceiverBase:
    """Store, counters and accessors shared by both transports. Exports land on receiver
    threads while tests read on theirs, hence one lock around every access.

    `status` is settable at runtime: anything but 200 rejects exports with that status (over
    gRPC: 503 UNAVAILABLE, 429 RESOURCE_EXHAUSTED, ...). Rejected requests still count in
    `requests`/`bytes_received` but store nothing. SDK exporters retry 503, not 400.
    `on_export(kind, n)` is called after each stored export ("traces"/"metrics", item count).
    """

    def __init__(self, port: int, decode: bool, host: str,
                 on_export: Callable[[str, int], None] | None) -> None:
        self.status = 200
        self.decode = decode
        self._host, self._port, self._on_export = host, port, on_export
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._metrics: list[ReceivedMetric] = []
        self._requests = self._bytes = 0

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        """Base URL "http://127.0.0.1:PORT"; OTLP/HTTP clients add /v1/traces, /v1/metrics."""
        if not self._port:
            raise RuntimeError("receiver not started: its port is not known yet")
        return f"http://{'127.0.0.1' if self._host == '0.0.0.0' else self._host}:{self._port}"

    @property
    def requests(self) -> int:
        with self._lock:
            return self._requests

    @property
    def bytes_received(self) -> int:
        """Request body bytes as sent (compressed, if the client compressed)."""
        with self._lock:
            return self._bytes

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def metrics(self) -> list[ReceivedMetric]:
        with self._lock:
            return list(self._metrics)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()
            self._metrics.clear()
            self._requests = self._bytes = 0

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool],
                 timeout: float = 10.0) -> list[ReceivedSpan]:
        """Poll until `predicate(spans)` holds: exporters batch, so spans arrive late."""
        return _poll(self.spans, predicate, timeout, "spans")

    def wait_for_metrics(self, predicate: Callable[[list[ReceivedMetric]], bool],
                         timeout: float = 10.0) -> list[ReceivedMetric]:
        """Poll until `predicate(metrics)` holds."""
        return _poll(self.metrics, predicate, timeout, "metrics")

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self._requests += 1
            self._bytes += nbytes

    def _record(self, kind: str, request: Any) -> None:
        items: list[Any] = _flatten_spans(request) if kind == "traces" \
            else _flatten_metrics(request)
        with self._lock:
            (self._spans if kind == "traces" else self._metrics).extend(items)
        if self._on_export is not None:
            self._on_export(kind, len(items))


def _poll(get: Callable[[], list[_T]], predicate: Callable[[list[_T]], bool], timeout: float,
          what: str) -> list[_T]:
    deadline = time.monotonic() + timeout
    while not predicate(items := get()):
        if time.monotonic() >= deadline:
            names = [getattr(x, "name", "?") for x in items]
            raise TimeoutError(f"no matching {what} after {timeout}s; got {len(items)}: {names}")
        time.sleep(0.05)
    return items


class OtlpReceiver(_ReceiverBase):
    """OTLP/HTTP on `host:port` (0 = a free port): POST /v1/traces and /v1/metrics with
    protobuf bodies (gzip or deflate optional), keep-alive HTTP/1.1. Anything else gets 404."""

    def __init__(self, port: int = 0, *, decode: bool = True, host: str = "127.0.0.1",
                 on_export: Callable[[str, int], None] | None = None) -> None:
        super().__init__(port, decode, host, on_export)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        ready: futures.Future[int] = futures.Future()
        self._loop = loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, args=(loop, ready), daemon=True,
                                        name="otlp-http-sink")
        self._thread.start()
        self._port = ready.result(timeout=10)  # re-raises a bind error here

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        self._thread = None

    def _run(self, loop: asyncio.AbstractEventLoop, ready: futures.Future[int]) -> None:
        asyncio.set_event_loop(loop)
        try:
            server = loop.run_until_complete(
                asyncio.start_server(self._serve, self._host, self._port))
        except OSError as e:
            ready.set_exception(e)
            loop.close()
            return
        ready.set_result(server.sockets[0].getsockname()[1])
        loop.run_forever()
        # Stopped: cancel idle keep-alive connections, or wait_closed() would wait for them.
        server.close()
        tasks = asyncio.all_tasks(loop)
        for t in tasks:
            t.cancel()
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.run_until_complete(asyncio.wait_for(server.wait_closed(), 2))
        loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection: request line, headers, body; answer; repeat while kept alive."""
        try:
            while line := await reader.readline():
                if not line.strip():
                    continue  # stray CRLF between requests
                method, target, version = line.decode("latin-1").split()
                headers: dict[str, str] = {}
                while (h := await reader.readline()).strip():
                    name, _, value = h.decode("latin-1").partition(":")
                    headers[name.strip().lower()] = value.strip()
                if headers.get("expect", "").lower() == "100-continue":  # curl, large bodies
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
                if "transfer-encoding" in headers:  # OTLP exporters send content-length
                    writer.write(_response_head(411, 0, keep=False))
                    break
                if (size := int(headers.get("content-length", "0"))) > MAX_BODY_BYTES:
                    writer.write(_response_head(413, 0, keep=False))
                    break
                body = await reader.readexactly(size)
                status, payload = self._handle(method, target, body,
                                               headers.get("content-encoding", ""))
                writer.write(_response_head(status, len(payload), keep) + payload)
                await writer.drain()
                if not keep:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass  # client went away or sent garbage: drop the connection
        except asyncio.CancelledError:
            pass  # the receiver is stopping; ending quietly keeps asyncio from logging it
        finally:
            writer.close()

    def _handle(self, method: str, target: str, body: bytes, encoding: str) -> tuple[int, bytes]:
        route = _ROUTES.get(target.split("?", 1)[0])
        if method != "POST" or route is None:
            return 404, b""
        kind, request_cls, ok = route
        self._count(len(body))
        if self.status != 200:
            return self.status, b""
        if self.decode:
            try:
                raw = _DECODERS.get(encoding.lower(), bytes)(body)
                request = request_cls.FromString(raw)
            except (OSError, EOFError, zlib.error, DecodeError):
                return 400, b""
            self._record(kind, request)
        return 200, ok


def _response_head(status: int, length: int, keep: bool) -> bytes:
    close = "" if keep else "Connection: close\r\n"
    return (f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\n"
            f"Content-Type: application/x-protobuf\r\nContent-Length: {length}\r\n{close}\r\n"
            ).encode("latin-1")


class OtlpGrpcReceiver(_ReceiverBase):
    """OTLP/gRPC on `host:port` (0 = a free port), on grpcio's own server threads. grpcio
    parses each request before we see it, so `decode=False` saves less than over HTTP."""

    def __init__(self, port: int = 0, *, decode: bool = True, host: str = "127.0.0.1",
                 on_export: Callable[[str, int], None] | None = None,
                 max_workers: int = 4) -> None:
        super().__init__(port, decode, host, on_export)
        self._max_workers = max_workers
        self._server: grpc.Server | None = None

    def start(self) -> None:
        server = grpc.server(futures.ThreadPoolExecutor(self._max_workers),
                             options=[("grpc.max_receive_message_length", MAX_BODY_BYTES)])
        # typed here: the generated *_pb2_grpc modules are unannotated
        add_traces: Callable[[Any, Any], None] = tsvc_grpc.add_TraceServiceServicer_to_server
        add_metrics: Callable[[Any, Any], None] = msvc_grpc.add_MetricsServiceServicer_to_server
        add_traces(self._servicer(tsvc_grpc.TraceServiceServicer, "traces",
                                  tsvc.ExportTraceServiceResponse), server)
        add_metrics(self._servicer(msvc_grpc.MetricsServiceServicer, "metrics",
                                   msvc.ExportMetricsServiceResponse), server)
        if not (port := server.add_insecure_port(f"{self._host}:{self._port}")):
            raise OSError(f"cannot bind OTLP/gRPC receiver to {self._host}:{self._port}")
        server.start()
        self._server, self._port = server, port

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=0.5).wait()
            self._server = None

    def _servicer(self, base: type, kind: str, response_cls: type[Message]) -> Any:
        """A generated servicer (`base`) whose Export stores into this receiver."""
        rx = self

        class Servicer(base):  # type: ignore[misc]  # a base class chosen at run time
            def Export(self, request: Any, context: grpc.ServicerContext) -> Message:
                rx._count(request.ByteSize())
                if rx.status != 200:
                    context.abort(_GRPC_CODES.get(rx.status, grpc.StatusCode.INTERNAL),
                                  f"receiver status set to {rx.status}")
                if rx.decode:
                    rx._record(kind, request)
                return response_cls()

        return Servicer()


def main(argv: list[str] | None = None) -> int:
    """Run a receiver until SIGINT/SIGTERM, printing a line per decoded export."""
    parser = argparse.ArgumentParser(prog="python -m telemetry.bench.otlp_sink",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, help="default 4318 (HTTP) or 4317 (gRPC)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--no-decode", action="store_true", help="only count requests/bytes")
    parser.add_argument("--grpc", action="store_true", help="OTLP/gRPC instead of OTLP/HTTP")
    args = parser.parse_args(argv)

    def log(kind: str, n: int) -> None:
        unit = "spans" if kind == "traces" else "metrics"
        print(f"{time.strftime('%H:%M:%S')} {kind}: {n} {unit}", flush=True)

    port = args.port if args.port is not None else (4317 if args.grpc else 4318)
    rx = (OtlpGrpcReceiver if args.grpc else OtlpReceiver)(
        port, decode=not args.no_decode, host=args.host, on_export=None if args.no_decode else log)
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    with rx:
        print(f"OTLP/{'gRPC' if args.grpc else 'HTTP'} sink on {rx.endpoint}", flush=True)
        while not stopping.wait(0.5):
            pass
    print(f"stopped: {rx.requests} requests, {rx.bytes_received} bytes", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
