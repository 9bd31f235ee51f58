"""The engine's step loop in a process of its own, driven from the server's event loop.

In one process the model step (a thread) and the event loop share one interpreter lock,
so every bit of Python the server runs per token (queue hops, SSE encoding, socket
writes) is time the step loop cannot run, and the other way round: with the tiny model on
two cores, the in-process ``AsyncEngine`` reached ~0.64 of what the bare step loop does.
``EngineClient`` keeps ``AsyncEngine``'s API (``generate``, ``abort``, ``state``,
``on_final``) and moves ``LLMEngine`` into a child process (``python -m
backend.engine.core_process``), as vLLM's V1 engine core does; the two run in parallel.

The wire is a Unix socket pair carrying frames of ``kind (1 byte) + length (4) + body``.
Parent to child: pickled operations (add, abort, shutdown). Child to parent: one
``marshal``-ed batch per step (output deltas as tuples, errors, the state snapshot); the
handshake (the engine's settings, or the error that stopped it from starting) is pickled.

Lifetimes: the child ignores SIGINT and SIGTERM (the server drains, then stops it) and
dies with its parent (end of file on the socket, read between any two steps). If it dies,
every open stream fails with ``EngineDeadError``, ``is_running`` turns false and
``on_dead`` is called (``serve`` then exits with status 1, for a supervisor to restart it).
"""

from __future__ import annotations

import asyncio
import logging
import marshal
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import errors as engine_errors
from .async_engine import AsyncEngine, _Abort, _Add
from .config import EngineConfig
from .errors import EngineDeadError, EngineError, InvalidRequestError
from .outputs import EngineState, OutputDelta, RequestMetrics
from .sampling import SamplingParams
from .tokenizer import Tokenizer
from .versions import ResolvedVersions

log = logging.getLogger("sluice.engine")

_HEAD = struct.Struct("!cI")  # kind, body length
_PICKLE, _MARSHAL = b"p", b"m"
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # holds the `backend` package


def _frame(kind: bytes, body: bytes) -> bytes:
    return _HEAD.pack(kind, len(body)) + body


def _take_frames(buf: bytearray) -> list[tuple[bytes, bytes]]:
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


# ---- the wire form of what the engine hands back ------------------------------------------
def _delta_to_wire(d: OutputDelta) -> tuple[Any, ...]:
    m = d.metrics
    return (d.request_id, d.text, d.token_ids, d.token_times, d.finished, d.finish_reason,
            d.num_prompt_tokens, d.num_cached_tokens, d.num_output_tokens,
            None if m is None else (
                m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time,
                m.token_times, m.num_preemptions, m.tokens_after_abort, m.prefill_chunks,
                m.abort_time))


def _delta_from_wire(t: tuple[Any, ...]) -> OutputDelta:
    m = t[9]
    return OutputDelta(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8],
                       None if m is None else RequestMetrics(*m))


def _state_to_wire(s: EngineState) -> tuple[Any, ...]:
    return tuple(getattr(s, name) for name in EngineState.__dataclass_fields__)


def _error_to_wire(rid: str, exc: BaseException) -> tuple[str, str, str, str | None]:
    return (rid, type(exc).__name__, str(exc), getattr(exc, "param", None))


def _error_from_wire(name: str, message: str, param: str | None) -> EngineError:
    cls = getattr(engine_errors, name, None)
    if isinstance(cls, type) and issubclass(cls, InvalidRequestError):
        return cls(message, param)
    if isinstance(cls, type) and issubclass(cls, EngineError):
        return cls(message)
    return EngineError(f"{name}: {message}")


# ---- the child --------------------------------------------------------------------------
class _FrameReader:
    """Frames from a blocking socket: ``read(block)`` returns the complete frames, waiting
    for the first one only when ``block``; None at end of file."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.eof = False

    def read(self, block: bool) -> list[tuple[bytes, bytes]] | None:
        frames: list[tuple[bytes, bytes]] = []
        while True:
            frames.extend(_take_frames(self.buf))
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

def child_main(fd: int) -> int:
    """Entry point of the engine process: build the engine, then step until told to stop
    or until the parent goes away."""
    # The server owns this process's life: a Ctrl-C, or a SIGTERM sent to the whole group
    # (systemd's default), must not kill the engine under requests the server is draining.
    # The server stops it when it is done, and its death (even SIGKILL) closes the socket:
    # end of file, read between any two steps (and waited on when idle), ends this one.
    # (Not PR_SET_PDEATHSIG: it fires when the *thread* that started us exits, and the
    # server may start us from a short-lived worker thread.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    reader = _FrameReader(sock)
    frames = reader.read(block=True)
    if not frames:
        return 0
    _kind, body = frames[0]
    config, log_level = pickle.loads(body)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s "
                        "[engine process]: %(message)s")
    from .builder import build_engine

    try:
        parts = build_engine(config)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        sock.sendall(_frame(_PICKLE, pickle.dumps(("error", _error_to_wire("", exc),
                                                   traceback.format_exc()))))
        return 1
    core = parts.core
    info = {"versions": parts.versions, "model_name": parts.model_name,
            "model_path": str(parts.model_path), "device": str(parts.device),
            "dtype": str(parts.dtype).removeprefix("torch."), "num_blocks": parts.num_blocks,
            "kv_bytes_per_block": parts.kv_bytes_per_block, "vocab_size": core.vocab_size,
            "max_model_len": core.max_model_len, "state": _state_to_wire(core.state()),
            "pid": os.getpid()}
    sock.sendall(_frame(_PICKLE, pickle.dumps(("ready", info))))
    try:
        _step_loop(core, sock, reader)
    except (BrokenPipeError, ConnectionResetError):  # the server is gone: nobody to serve
        return 0
    except BaseException:  # tell the parent why, then die
        try:
            sock.sendall(_frame(_PICKLE, pickle.dumps(("dead", traceback.format_exc()))))
        except OSError:
            pass
        raise
    return 0


def _step_loop(core: Any, sock: socket.socket, reader: _FrameReader) -> None:
    to_wire, dumps = _delta_to_wire, marshal.dumps
    while True:
        frames = reader.read(block=not core.has_work())
        if frames is None:  # the parent is gone: nobody to serve
            return
        deltas: list[OutputDelta] = []
        errors: list[tuple[str, str, str, str | None]] = []
        stopping = False
        for _kind, body in frames:
            op = pickle.loads(body)
            if op[0] == "add":
                _, rid, prompt, params, priority, salt, arrival = op
                try:
                    core.add_request(rid, prompt, params, priority=priority, cache_salt=salt,
                                     arrival_time=arrival)
                except InvalidRequestError as exc:
                    errors.append(_error_to_wire(rid, exc))
            elif op[0] == "abort":
                _, rid, at = op
                core.mark_abort(rid, at=at)
                delta = core.abort(rid)
                if delta is not None:
                    deltas.append(delta)
            elif op[0] == "shutdown":
                stopping = True
        if stopping:
            deltas.extend(core.abort_all())
        elif core.has_work():
            deltas.extend(core.step())
        body = dumps(([to_wire(d) for d in deltas], errors, _state_to_wire(core.state())))
        sock.sendall(_frame(_MARSHAL, body))
        if stopping:
            sock.sendall(_frame(_PICKLE, pickle.dumps(("bye",))))
            return


# ---- the parent -------------------------------------------------------------------------
class _Validator:
    """What the server and ``AsyncEngine.generate`` read of the core, parent side: the
    request checks (on immutable settings) and the clock of the engine's timestamps."""

    def __init__(self, vocab_size: int, max_model_len: int, state: EngineState) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._state = state
        self.clock: Callable[[], float] = time.monotonic  # CLOCK_MONOTONIC: one per host

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        from .engine import validate_request

        validate_request(prompt_token_ids, params, self.vocab_size, self.max_model_len)

    def state(self) -> EngineState:
        """The snapshot the engine process sent when it became ready."""
        return self._state


@dataclass(slots=True, frozen=True)
class RemoteParts:
    """What the server reads of an engine built in the engine process."""

    tokenizer: Tokenizer
    versions: ResolvedVersions
    model_name: str
    model_path: Path
    device: str
    dtype: str
    num_blocks: int
    kv_bytes_per_block: int
    pid: int


class _Wire(asyncio.Protocol):
    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        for kind, body in _take_frames(self.buf):
            self.client._received(kind, body)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client._lost(exc)


class EngineClient(AsyncEngine):
    """``AsyncEngine``'s API over an engine that runs in a child process."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket, info: dict[str, Any],
                 tokenizer: Tokenizer) -> None:
        self.proc = proc
        self._sock: socket.socket | None = sock
        validator = _Validator(info["vocab_size"], info["max_model_len"],
                               EngineState(*info["state"]))
        parts = RemoteParts(tokenizer=tokenizer, versions=info["versions"],
                            model_name=info["model_name"], model_path=Path(info["model_path"]),
                            device=info["device"], dtype=info["dtype"],
                            num_blocks=info["num_blocks"],
                            kv_bytes_per_block=info["kv_bytes_per_block"], pid=info["pid"])
        super().__init__(validator, parts)  # type: ignore[arg-type]
        self._wire: _Wire | None = None
        self._closed = False  # the socket to the engine process is gone
        self._bye: asyncio.Future[None] | None = None

    @classmethod
    def from_config(cls, config: Any) -> EngineClient:
        """Start the engine process, which loads the model; returns once it is ready.
        Raises the engine's error (bad checkpoint, bad setting) if it cannot start."""
        from .builder import resolve_model_path

        assert isinstance(config, EngineConfig)
        path, _name = resolve_model_path(config)  # builds "tiny" here, once, before the child
        tokenizer = Tokenizer.from_dir(path)
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH")) if p)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "backend.engine.core_process", str(child.fileno())],
                pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL)
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        try:
            level = logging.getLogger("sluice").getEffectiveLevel()
            parent.sendall(_frame(_PICKLE, pickle.dumps((config, level))))
            reply = _FrameReader(parent).read(block=True)
            if not reply:
                code = proc.wait(timeout=10)
                raise EngineDeadError(f"the engine process exited while starting (code {code})")
            msg = pickle.loads(reply[0][1])
            if msg[0] == "error":
                _rid, name, message, param = msg[1]
                log.debug("engine process failed to start:\n%s", msg[2])
                proc.wait(timeout=10)
                raise _error_from_wire(name, message, param)
            return cls(proc, parent, msg[1], tokenizer)
        except BaseException:
            parent.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            raise

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        if self._wire is not None or self._sock is None:
            return
        self._loop = asyncio.get_running_loop()
        self._sock.setblocking(False)
        _, self._wire = await self._loop.create_unix_connection(
            lambda: _Wire(self), sock=self._sock)
        self._bye = self._loop.create_future()

    async def shutdown(self) -> None:
        """Abort everything still running, then stop the engine process."""
        self._stopping = True
        if self._wire is not None and self._wire.transport is not None:
            if not self._wire.transport.is_closing():
                self._send(("shutdown",))
                assert self._bye is not None
                try:
                    await asyncio.wait_for(asyncio.shield(self._bye), 30)
                except TimeoutError:
                    log.warning("the engine process did not stop within 30 s; killing it")
                    self.proc.kill()
            self._wire.transport.close()
        elif self._sock is not None:
            self._sock.close()
        self._sock = None
        await asyncio.to_thread(self._reap)

    def _reap(self) -> None:
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    @property
    def is_running(self) -> bool:
        """The engine process is up (also while it shuts down: the final deltas of what it
        aborts are still to come)."""
        return self._wire is not None and not self._closed and self._dead is None

    def _accepting(self) -> bool:
        wire = self._wire
        return (wire is not None and wire.transport is not None and not self._stopping
                and not wire.transport.is_closing())

    # ---- requests -----------------------------------------------------------------------
    def _submit(self, op: _Add | _Abort) -> None:
        # Only `generate` submits here: `abort` is overridden and sends its own message.
        assert isinstance(op, _Add)
        self._send(("add", op.request_id, op.prompt_token_ids, op.params, op.priority,
                    op.cache_salt, op.arrival_time))

    def _send(self, op: tuple[Any, ...]) -> None:
        wire = self._wire
        if wire is None or wire.transport is None or wire.transport.is_closing():
            if self._dead is None:
                raise EngineDeadError("engine is not started")
            raise EngineDeadError("the engine process has exited") from self._dead
        wire.transport.write(_frame(_PICKLE, pickle.dumps(op, 5)))

    def abort(self, request_id: str) -> None:
        """Ask the engine process to abort a request (unknown ids are a no-op). Safe from
        any thread (a stream dropped without closing is aborted by the garbage collector,
        wherever it runs); a stopped or dead engine has nothing left to abort."""
        loop = self._loop
        if self._dead is not None or loop is None:
            return
        at = time.monotonic()  # when it was asked for, not when the loop gets to it
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:  # no loop runs in this thread
            on_loop = False
        if on_loop:
            self._abort_now(request_id, at)
            return
        try:
            loop.call_soon_threadsafe(self._abort_now, request_id, at)
        except RuntimeError:  # the loop is closed
            pass

    def _abort_now(self, request_id: str, at: float) -> None:
        if self._accepting():
            self._send(("abort", request_id, at))

    # ---- from the engine process ----------------------------------------------------------
    def _received(self, kind: bytes, body: bytes) -> None:
        if kind == _MARSHAL:
            wire_deltas, wire_errors, state = marshal.loads(body)
            self._snapshot = EngineState(*state)
            if not wire_deltas and not wire_errors:
                return
            deltas = [_delta_from_wire(t) for t in wire_deltas]
            errors = [(rid, _error_from_wire(name, message, param))
                      for rid, name, message, param in wire_errors]
            self._dispatch(deltas, errors)  # type: ignore[arg-type]
            return
        msg = pickle.loads(body)
        if msg[0] == "bye":
            if self._bye is not None and not self._bye.done():
                self._bye.set_result(None)
        elif msg[0] == "dead":
            log.error("the engine process failed:\n%s", msg[1])
            self._dead = EngineDeadError("the engine's step loop failed in its process")

    def _lost(self, exc: Exception | None) -> None:
        self._closed = True
        if self._bye is not None and not self._bye.done():
            self._bye.set_result(None)
        if self._dead is None and not self._stopping:
            code = self.proc.poll()
            self._dead = EngineDeadError(
                "the engine process exited" + (f" (code {code})" if code is not None else ""))
            log.error("%s; failing its %d open request(s)", self._dead, len(self._streams))
        # Every stream still open ends now: after a normal shutdown each one already has
        # its final (abort) delta and ignores this; if the process died or was killed,
        # this is their end. A list: a stream collected on another thread may leave.
        err = EngineDeadError(f"engine stopped: {self._dead or 'shut down'}")
        for queue in list(self._streams.values()):
            queue.put_nowait(err)
        if not self._stopping:
            self._notify_dead()

if __name__ == "__main__":
    sys.exit(child_main(int(sys.argv[1])))
