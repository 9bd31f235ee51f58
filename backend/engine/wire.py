"""The socket between the server and its engine process: frames and the wire forms.

A frame is ``kind (1 byte) + length (4) + body``. Server to engine: pickled operations
(``("add", ...)``, ``("abort", request_id, asked_at)``, ``("shutdown",)``). Engine to
server: one ``marshal``-ed batch per step (output deltas as tuples, refusals, the state
snapshot: marshal is several times cheaper than pickle for these plain tuples); the
handshake and the last words (``ready``, ``error``, ``dead``, ``bye``) are pickled.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

from modelfiles import errors as modelfile_errors
from modelfiles.errors import ModelFileError

from . import errors as engine_errors
from .errors import EngineError, InvalidRequestError
from .outputs import EngineState, OutputDelta, RequestMetrics, TokenLogprob

_HEAD = struct.Struct("!cI")  # kind, body length
PICKLE, MARSHAL = b"p", b"m"

WireError = tuple[str, str, str, str | None]  # request id, class name, message, param


def frame(kind: bytes, body: bytes) -> bytes:
    return _HEAD.pack(kind, len(body)) + body


def take_frames(buf: bytearray) -> list[tuple[bytes, bytes]]:
    """Remove the complete frames from the front of ``buf``; (kind, body) each."""
    out = []
    pos, size, end = 0, _HEAD.size, len(buf)
    while end - pos >= size:
        kind, n = _HEAD.unpack_from(buf, pos)
        if end - pos - size < n:
            break
        out.append((kind, bytes(buf[pos + size:pos + size + n])))
        pos += size + n
    if pos:
        del buf[:pos]
    return out


class FrameReader:
    """Frames from a blocking socket: ``read(block)`` returns the complete frames, waiting
    for the first one only when ``block``; None at end of file."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.eof = False

    def read(self, block: bool) -> list[tuple[bytes, bytes]] | None:
        frames: list[tuple[bytes, bytes]] = []
        while True:
            frames.extend(take_frames(self.buf))
            if self.eof:
                return frames or None
            if frames or not block:
                # drain whatever else is already there, without waiting
                try:
                    data = self.sock.recv(1 << 20, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    return frames
                except ConnectionResetError:  # the peer died with data unread
                    data = b""
            else:
                try:
                    data = self.sock.recv(1 << 20)
                except ConnectionResetError:
                    data = b""
            if data:
                self.buf += data
            else:
                self.eof = True


# ---- what the engine hands back ----------------------------------------------------------
def delta_to_wire(d: OutputDelta) -> tuple[Any, ...]:
    m = d.metrics
    return (d.request_id, d.text, d.token_ids, d.token_times, d.finished, d.finish_reason,
            d.num_prompt_tokens, d.num_cached_tokens, d.num_output_tokens,
            None if m is None else (
                m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time,
                m.token_times, m.num_preemptions, m.tokens_after_abort, m.prefill_chunks,
                m.abort_time),
            None if d.logprobs is None else tuple((x.logprob, x.top) for x in d.logprobs),
            d.index)


def delta_from_wire(t: tuple[Any, ...]) -> OutputDelta:
    m, lps = t[9], t[10]
    return OutputDelta(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8],
                       None if m is None else RequestMetrics(*m),
                       None if lps is None else tuple(TokenLogprob(*x) for x in lps), t[11])


def state_to_wire(s: EngineState) -> tuple[Any, ...]:
    return tuple(getattr(s, name) for name in EngineState.__dataclass_fields__)


def state_from_wire(t: tuple[Any, ...]) -> EngineState:
    return EngineState(*t)


def error_to_wire(rid: str, exc: BaseException) -> WireError:
    return (rid, type(exc).__name__, str(exc), getattr(exc, "param", None))


def error_from_wire(name: str, message: str,
                    param: str | None) -> EngineError | ModelFileError:
    """The engine's error again, same class and parameter; a class of neither the engine
    nor modelfiles (a checkpoint the engine cannot load fails with ModelLoadError …)
    becomes an ``EngineError`` naming it."""
    cls = getattr(engine_errors, name, None) or getattr(modelfile_errors, name, None)
    if isinstance(cls, type) and issubclass(cls, InvalidRequestError):
        return cls(message, param)
    if isinstance(cls, type) and issubclass(cls, (EngineError, ModelFileError)):
        err: EngineError | ModelFileError = cls(message)
        return err
    return EngineError(f"{name}: {message}")
