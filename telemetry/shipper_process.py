"""The span shipper's process: ``python -m telemetry.shipper_process`` (see
``telemetry.shipper`` for the protocol). Reads span records on stdin, encodes them to OTLP,
batches and sends them; reports ``ok N`` / ``fail N`` / ``flushed`` on stdout."""

from __future__ import annotations

import json
import logging
import marshal
import os
import select
import sys
import time
from collections.abc import Mapping
from typing import Any

from telemetry.shipper import _LEN, _LOG_EVERY_S

log = logging.getLogger("sluice.telemetry")


def _transport(cfg: Mapping[str, Any]) -> Any:
    from .export import OtlpGrpc, OtlpHttp

    if cfg["protocol"] == "grpc":
        return OtlpGrpc(cfg["url"], cfg["resource"], cfg["headers"], cfg["timeout_s"])
    return OtlpHttp(cfg["url"], cfg["resource"], cfg["headers"], cfg["timeout_s"])


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Background work: on a busy machine the serving process and its clients come first;
    # the shipper catches up when they leave a core idle (its pipe and the parent's bounded
    # queue absorb the lag, and spans past that are dropped and counted, never waited for).
    try:
        os.nice(10)
    except OSError:
        pass
    fd = sys.stdin.fileno()
    # Raw reads only: a buffered reader would read frames past the settings line into its
    # own buffer, where the os.read loop below would never see them.
    buf = b""
    while b"\n" not in buf:
        data = os.read(fd, 65536)
        if not data:
            return 0
        buf += data
    line, buf = buf.split(b"\n", 1)
    cfg = json.loads(line)
    transport = _transport(cfg)
    encoder = transport.encoder
    max_batch, delay = int(cfg["max_batch"]), float(cfg["delay_s"])
    out = sys.stdout
    pending: list[tuple[tuple[str, str], bytes, int]] = []
    spans = 0
    last_send = time.monotonic()
    last_log = -_LOG_EVERY_S
    unlogged = 0

    def ship() -> None:
        nonlocal pending, spans, last_send, last_log, unlogged
        if pending:
            try:
                transport.send(pending)
                out.write(f"ok {spans}\n")
            except Exception as exc:  # noqa: BLE001 - log, count, go on
                out.write(f"fail {spans}\n")
                unlogged += spans
                if time.monotonic() - last_log >= _LOG_EVERY_S:
                    log.warning("span export failed (%d spans dropped since the last "
                                "message): %s: %s", unlogged, type(exc).__name__, exc)
                    last_log, unlogged = time.monotonic(), 0
            out.flush()
        pending, spans, last_send = [], 0, time.monotonic()

    while True:
        # frames already read (some may have come with the settings line); walked by offset:
        # slicing the rest off after each frame would copy a 1 MiB read once per frame
        pos, size = 0, len(buf)
        while size - pos >= 4:
            (n,) = _LEN.unpack_from(buf, pos)
            if size - pos < 4 + n:
                break
            frame = buf[pos + 4:pos + 4 + n]
            pos += 4 + n
            if not n:  # flush
                ship()
                out.write("flushed\n")
                out.flush()
                continue
            try:
                item = marshal.loads(frame)
                if len(item) != 3:  # a span tree record, to encode here
                    item = encoder.prepare_record(item)
                elif not (isinstance(item[1], bytes) and isinstance(item[2], int)):
                    raise ValueError("a pre-encoded item is (scope, bytes, span count)")
            except Exception:  # one bad record must not stop the rest
                log.warning("a span record could not be encoded", exc_info=True)
                out.write("fail 1\n")
                continue
            pending.append(item)
            spans += item[2]
            if spans >= max_batch:
                ship()
        buf = buf[pos:]
        wait = max(0.0, last_send + delay - time.monotonic()) if pending else None
        ready, _, _ = select.select([fd], [], [], wait)
        if not ready:
            ship()
            continue
        data = os.read(fd, 1 << 20)
        if not data:
            break
        buf += data
    ship()
    transport.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
