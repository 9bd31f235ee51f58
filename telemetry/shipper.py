"""The span shipper: OTLP encoding and export in a child process.

Encoding a request's spans to protobuf in Python costs more CPU than creating them (~35 µs
a request), and in the serving process every microsecond of it is taken from the event
loop, GIL included, however it is threaded. So by default (``traces.export_process``)
sending happens in ``python -m telemetry.shipper_process``, which batches and sends over
OTLP/HTTP or gRPC on another core. What the serving process hands it depends on the
encoder: with the C one (``telemetry/_otlp.c``, ~6 µs a request, about what ``marshal``ing
the span tree costs) it encodes the spans itself and the shipper only frames and sends
them; with the pure-Python one it ``marshal``s the span tree and the shipper encodes.

Protocol, parent → shipper on stdin: one JSON line (the settings), then frames of
``<u32 little-endian length><marshal'd item>``, where an item is either a span tree
record (``otlp.to_record``, 17 fields) or an encoded one, ``(scope, bytes, span count)``
(``Encoder.prepare_record``); a zero-length frame asks for a flush.
Shipper → parent on stdout, one line per event: ``ok N`` (N spans delivered),
``fail N`` (N spans lost; the reason is logged on stderr, which is the parent's),
``flushed``. End of stdin (the parent closed it, or died) makes the shipper send what it
holds and exit. If the shipper dies, the parent counts what it could not hand over as
failed and starts a new one (at most every 5 s).
"""

from __future__ import annotations

import fcntl
import json
import logging
import marshal
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from . import otlp
from .otlp import Encoder, to_record
from .tracing import Span

log = logging.getLogger("sluice.telemetry")

_LEN = struct.Struct("<I")
_F_SETPIPE_SZ = 1031
_RESTART_EVERY_S = 5.0
_LOG_EVERY_S = 30.0

class ShipperTransport:
    """The parent's end (a ``Transport`` for ``BatchExporter``)."""

    reports_delivery = True  # exported/failed come from the shipper, not from send()
    handoff_s = 0.05  # BatchExporter hands spans over this often; the shipper batches them

    def __init__(self, settings: Mapping[str, Any]) -> None:
        self._settings = json.dumps(dict(settings)).encode() + b"\n"
        # spans are encoded here when the encoder is C (see the module docstring)
        self._encoder = Encoder({}) if otlp.NATIVE else None
        self.exported = 0
        self.failed = 0
        self._flushes = 0
        self._flushed = threading.Condition()
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_at = -_RESTART_EVERY_S
        self._start()

    def _start(self) -> bool:
        now = time.monotonic()
        if now - self._started_at < _RESTART_EVERY_S:
            return False
        self._started_at = now
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        os.environ.get("PYTHONPATH")) if p)}
        proc = subprocess.Popen([sys.executable, "-m", "telemetry.shipper_process"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        assert proc.stdin is not None
        try:  # Linux: a 1 MiB pipe takes a hand-off in one write, not sixteen 64 KiB ones
            fcntl.fcntl(proc.stdin.fileno(), _F_SETPIPE_SZ, 1 << 20)
        except (OSError, AttributeError):
            pass
        proc.stdin.write(self._settings)
        proc.stdin.flush()
        self._proc = proc
        threading.Thread(target=self._read, args=(proc,), name="sluice-shipper-status",
                         daemon=True).start()
        return True

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            word, _, n = line.decode(errors="replace").partition(" ")
            if word == "ok":
                self.exported += int(n)
            elif word == "fail":
                self.failed += int(n)
            elif word.strip() == "flushed":
                with self._flushed:
                    self._flushes += 1
                    self._flushed.notify_all()

    def prepare(self, span: Span) -> bytes:
        record = to_record(span)
        if self._encoder is not None:  # the C encoder: as cheap as marshalling the tree
            data = marshal.dumps(self._encoder.prepare_record(record), 2)
        else:
            data = marshal.dumps(record, 2)  # version 2: no ref table, ~10 % faster
        return _LEN.pack(len(data)) + data

    def send(self, items: Sequence[bytes]) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            if not self._start():
                raise RuntimeError("the span shipper exited; it is restarted at most every "
                                   f"{_RESTART_EVERY_S:g} s")
            proc = self._proc
        assert proc is not None and proc.stdin is not None
        try:
            proc.stdin.write(b"".join(items))
            proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError) as exc:
            raise RuntimeError(f"the span shipper is gone: {exc}") from None

    def flush(self, timeout_s: float) -> bool:
        proc = self._proc
        if proc is None or proc.poll() is not None or proc.stdin is None:
            return False
        with self._flushed:
            start = self._flushes
            try:
                proc.stdin.write(_LEN.pack(0))
                proc.stdin.flush()
            except (BrokenPipeError, ValueError, OSError):
                return False
            return self._flushed.wait_for(lambda: self._flushes > start, timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        proc = self._proc
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()  # end of input: the shipper sends what it holds and exits
            proc.wait(timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
