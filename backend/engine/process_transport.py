"""``CoreTransport`` with the engine core stepping in an engine process of its own.

``ProcessTransport.from_config`` starts ``python -m backend.engine.core_process`` (which
builds the engine and steps it: see there for why a process) on one end of a Unix socket
pair and waits for its handshake; the event loop then reads the other end as an asyncio
protocol (``wire.py`` has the frames). Requests and aborts go out as they come; each step's
outputs come back as one frame, delivered to the front as they arrive.

Lifetimes: the engine process dies with its parent (end of file on the socket). If it dies
first, ``events.stopped`` gets an ``EngineDeadError`` (``serve`` then exits with status 1,
for a supervisor to restart it).
"""

from __future__ import annotations

import asyncio
import logging
import marshal
import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from modelfiles.tokenizer import Tokenizer

from .config import EngineConfig, resolve_model_path
from .errors import EngineDeadError
from .limits import RequestLimits
from .outputs import EngineState
from .transport import AddRequest, CoreEvents, EngineInfo
from .wire import (
    MARSHAL,
    PICKLE,
    FrameReader,
    delta_from_wire,
    error_from_wire,
    frame,
    state_from_wire,
    take_frames,
)

if TYPE_CHECKING:
    from .engine import StepHook

log = logging.getLogger("sluice.engine")

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # holds the `backend` package
SHUTDOWN_TIMEOUT_S = 30.0


class _Wire(asyncio.Protocol):
    def __init__(self, owner: ProcessTransport) -> None:
        self.owner = owner
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream socket's

    def data_received(self, data: bytes) -> None:
        self.buf += data
        for kind, body in take_frames(self.buf):
            self.owner._received(kind, body)

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner._lost()


class ProcessTransport:
    """Drive an ``LLMEngine`` that steps in a child process; see ``transport.CoreTransport``."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket, info: EngineInfo,
                 state: EngineState) -> None:
        self.proc = proc
        self._sock: socket.socket | None = sock
        self._info = info
        self._snapshot = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: CoreEvents | None = None
        self._wire: _Wire | None = None
        self._stopping = False
        self._closed = False  # the socket to the engine process is gone
        self._failure: EngineDeadError | None = None  # its step loop raised (it said so)
        self._bye: asyncio.Future[None] | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, *,
                    step_hook: StepHook | None = None) -> ProcessTransport:
        """Start the engine process, which loads the model; returns once it is ready.
        Raises the engine's error (bad checkpoint, bad setting) if it cannot start.
        ``step_hook`` must pickle (a module-level class or function): it runs there."""
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
            parent.sendall(frame(PICKLE, pickle.dumps((config, step_hook, level))))
            reply = FrameReader(parent).read(block=True)
            if not reply:
                code = proc.wait(timeout=10)
                raise EngineDeadError(f"the engine process exited while starting (code {code})")
            msg = pickle.loads(reply[0][1])
            if msg[0] == "error":
                _rid, name, message, param = msg[1]
                log.debug("engine process failed to start:\n%s", msg[2])
                proc.wait(timeout=10)
                raise error_from_wire(name, message, param)
            ready = msg[1]
            info = EngineInfo(tokenizer=tokenizer, **ready["info"])
            return cls(proc, parent, info, state_from_wire(ready["state"]))
        except BaseException:
            parent.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            raise

    # ---- what the front reads -----------------------------------------------------------
    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def limits(self) -> RequestLimits:
        return self._info.limits

    def clock(self) -> float:
        return time.monotonic()  # the engine's clock too: CLOCK_MONOTONIC is one per host

    @property
    def accepting(self) -> bool:
        wire = self._wire
        return (wire is not None and wire.transport is not None and not self._stopping
                and not wire.transport.is_closing())

    @property
    def alive(self) -> bool:
        """Up, also while it shuts down (the final deltas of what it aborts are due)."""
        return self._wire is not None and not self._closed and self._failure is None

    def state(self) -> EngineState:
        return self._snapshot

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self, events: CoreEvents) -> None:
        if self._wire is not None or self._sock is None:
            return
        self._events = events
        self._loop = asyncio.get_running_loop()
        self._sock.setblocking(False)
        _, self._wire = await self._loop.create_unix_connection(
            lambda: _Wire(self), sock=self._sock)
        self._bye = self._loop.create_future()

    async def shutdown(self) -> None:
        """Abort everything still running, then stop the engine process."""
        self._stopping = True
        if self._wire is not None and self._wire.transport is not None:
            if not self._wire.transport.is_closing() and self._bye is not None:
                self._send(("shutdown",))
                try:
                    await asyncio.wait_for(asyncio.shield(self._bye), SHUTDOWN_TIMEOUT_S)
                except TimeoutError:
                    log.warning("the engine process did not stop within %.0f s; killing it",
                                SHUTDOWN_TIMEOUT_S)
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

    # ---- requests -----------------------------------------------------------------------
    def add(self, request: AddRequest) -> None:
        r = request
        self._send(("add", r.request_id, r.prompt_token_ids, r.params, r.priority,
                    r.cache_salt, r.arrival_time))

    def _send(self, op: tuple[Any, ...]) -> None:
        wire = self._wire
        if wire is None or wire.transport is None or wire.transport.is_closing():
            if self._failure is not None:
                raise EngineDeadError("the engine process has failed") from self._failure
            if self._closed:
                raise EngineDeadError("the engine process has exited")
            raise EngineDeadError("engine is not started")
        wire.transport.write(frame(PICKLE, pickle.dumps(op, 5)))

    def abort(self, request_id: str) -> None:
        """Safe from any thread (a stream dropped without closing is aborted by the garbage
        collector, wherever it runs); a stopped or dead engine has nothing left to abort."""
        loop = self._loop
        if loop is None or self._closed or self._failure is not None:
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
        if self.accepting:
            self._send(("abort", request_id, at))

    # ---- from the engine process, on the event loop -------------------------------------
    def _received(self, kind: bytes, body: bytes) -> None:
        if kind == MARSHAL:
            wire_deltas, wire_errors, state = marshal.loads(body)
            self._snapshot = state_from_wire(state)
            if (wire_deltas or wire_errors) and self._events is not None:
                deltas = [delta_from_wire(t) for t in wire_deltas]
                errors: list[tuple[str, Exception]] = [
                    (rid, error_from_wire(name, message, param))
                    for rid, name, message, param in wire_errors]
                self._events.deliver(deltas, errors)
            return
        msg = pickle.loads(body)
        if msg[0] == "bye":
            if self._bye is not None and not self._bye.done():
                self._bye.set_result(None)
        elif msg[0] == "dead":
            log.error("the engine process failed:\n%s", msg[1])
            self._failure = EngineDeadError("the engine's step loop failed in its process")

    def _lost(self) -> None:
        self._closed = True
        if self._bye is not None and not self._bye.done():
            self._bye.set_result(None)
        error = self._failure
        if error is None and not self._stopping:
            code = self.proc.poll()
            error = EngineDeadError(
                "the engine process exited" + (f" (code {code})" if code is not None else ""))
        if self._events is not None:
            self._events.stopped(error)
