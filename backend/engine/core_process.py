"""The engine process: ``python -m backend.engine.core_process FD`` builds the engine and
steps it, talking to the server over the socket ``FD`` (``wire.py``).

In one process the model step (a thread) and the event loop share one interpreter lock,
so every bit of Python the server runs per token (queue hops, SSE encoding, socket
writes) is time the step loop cannot run, and the other way round: with the tiny model on
two cores, the in-process engine reached ~0.64 of what the bare step loop does. Here the
``LLMEngine`` steps in a process of its own, as vLLM's V1 engine core does, and the two
run in parallel; ``process_transport.ProcessTransport`` is the server's side.

Lifetimes: this process ignores SIGINT and SIGTERM (the server drains, then stops it) and
dies with its parent (end of file on the socket, read between any two steps).
"""

from __future__ import annotations

import logging
import marshal
import pickle
import signal
import socket
import sys
import traceback
from dataclasses import fields
from typing import TYPE_CHECKING

from .errors import InvalidRequestError
from .outputs import OutputDelta
from .wire import (
    MARSHAL,
    PICKLE,
    FrameReader,
    WireError,
    delta_to_wire,
    error_to_wire,
    frame,
    state_to_wire,
)

if TYPE_CHECKING:
    from .engine import LLMEngine


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
    reader = FrameReader(sock)
    frames = reader.read(block=True)
    if not frames:
        return 0
    _kind, body = frames[0]
    # The composition root's choices: the config, the step hook (fault injection), if any.
    config, step_hook, log_level = pickle.loads(body)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s "
                        "[engine process]: %(message)s")
    from .builder import build_engine

    try:
        parts = build_engine(config, step_hook=step_hook)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        sock.sendall(frame(PICKLE, pickle.dumps(("error", error_to_wire("", exc),
                                                 traceback.format_exc()))))
        return 1
    built = parts.info()
    # The server loads its own tokenizer from the same files; the rest crosses as it is.
    info = {f.name: getattr(built, f.name) for f in fields(built) if f.name != "tokenizer"}
    ready = {"info": info, "state": state_to_wire(parts.core.state())}
    sock.sendall(frame(PICKLE, pickle.dumps(("ready", ready))))
    try:
        _step_loop(parts.core, sock, reader)
    except (BrokenPipeError, ConnectionResetError):  # the server is gone: nobody to serve
        return 0
    except BaseException:  # tell the parent why, then die
        try:
            sock.sendall(frame(PICKLE, pickle.dumps(("dead", traceback.format_exc()))))
        except OSError:
            pass
        raise
    return 0


def _step_loop(core: LLMEngine, sock: socket.socket, reader: FrameReader) -> None:
    to_wire, dumps = delta_to_wire, marshal.dumps
    while True:
        frames = reader.read(block=not core.has_work())
        if frames is None:  # the parent is gone: nobody to serve
            return
        deltas: list[OutputDelta] = []
        errors: list[WireError] = []
        stopping = False
        for _kind, body in frames:
            op = pickle.loads(body)
            if op[0] == "add":
                _, rid, prompt, params, priority, salt, arrival = op
                try:
                    core.add_request(rid, prompt, params, priority=priority, cache_salt=salt,
                                     arrival_time=arrival)
                except InvalidRequestError as exc:
                    errors.append(error_to_wire(rid, exc))
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
            core.close()
        elif core.has_work():
            deltas.extend(core.step())
            # requests refused after they were added (a grammar that failed to compile)
            errors.extend(error_to_wire(rid, exc) for rid, exc in core.take_refusals())
        body = dumps(([to_wire(d) for d in deltas], errors, state_to_wire(core.state())))
        sock.sendall(frame(MARSHAL, body))
        if stopping:
            sock.sendall(frame(PICKLE, pickle.dumps(("bye",))))
            return


if __name__ == "__main__":
    sys.exit(child_main(int(sys.argv[1])))
