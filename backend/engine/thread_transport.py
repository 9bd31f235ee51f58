"""``CoreTransport`` with the engine core stepping on a worker thread of this process.

Requests and aborts are queued to the worker and applied between two steps, so an abort
frees the request's blocks before the next forward pass. Each step's outputs reach the
event loop with one ``call_soon_threadsafe``. The model step runs on the worker, never on
the loop; the interpreter lock is shared with it, which is why ``sluice backend`` steps the
core in a process of its own by default (``process_transport.py``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import EngineDeadError, InvalidRequestError
from .limits import RequestLimits
from .outputs import EngineState, OutputDelta
from .transport import AddRequest, CoreEvents, EngineInfo, Refusal

if TYPE_CHECKING:
    from .config import EngineConfig
    from .engine import LLMEngine, StepHook

log = logging.getLogger("sluice.engine")


@dataclass(slots=True, frozen=True)
class _Abort:
    request_id: str


class ThreadTransport:
    """Drive an ``LLMEngine`` on a worker thread; see ``transport.CoreTransport``."""

    def __init__(self, core: LLMEngine, info: EngineInfo | None = None) -> None:
        self.core = core
        self._info = info
        self._cv = threading.Condition()
        self._ops: list[AddRequest | _Abort] = []
        self._stopping = False
        self._crashed = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: CoreEvents | None = None
        self._snapshot: EngineState = core.state()

    @classmethod
    def from_config(cls, config: EngineConfig, *,
                    step_hook: StepHook | None = None) -> ThreadTransport:
        """Load the model, tokenizer and KV cache that ``config`` names."""
        from .builder import build_engine

        parts = build_engine(config, step_hook=step_hook)
        return cls(parts.core, parts.info())

    # ---- what the front reads -----------------------------------------------------------
    @property
    def info(self) -> EngineInfo | None:
        return self._info

    @property
    def limits(self) -> RequestLimits:
        return self.core.limits

    def clock(self) -> float:
        return self.core.clock()

    @property
    def accepting(self) -> bool:
        return self._thread is not None and not self._stopping and not self._crashed

    @property
    def alive(self) -> bool:
        return self._thread is not None and not self._crashed

    def state(self) -> EngineState:
        return self._snapshot

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self, events: CoreEvents) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._events = events
        self._thread = threading.Thread(target=self._run, name="sluice-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        with self._cv:
            self._stopping = True
            self._cv.notify()
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    # ---- requests -----------------------------------------------------------------------
    def add(self, request: AddRequest) -> None:
        self._submit(request)

    def abort(self, request_id: str) -> None:
        self.core.mark_abort(request_id)  # how far it got when asked (reads, any thread)
        self._submit(_Abort(request_id))

    def _submit(self, op: AddRequest | _Abort) -> None:
        with self._cv:
            self._ops.append(op)
            self._cv.notify()

    # ---- worker thread ------------------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        try:
            while True:
                with self._cv:
                    while not self._ops and not self._stopping and not core.has_work():
                        self._cv.wait()
                    ops, self._ops = self._ops, []
                    stopping = self._stopping
                deltas: list[OutputDelta] = []
                errors: list[Refusal] = []
                for op in ops:
                    self._apply(op, deltas, errors)
                if stopping:
                    deltas.extend(core.abort_all())
                    core.close()
                    self._snapshot = core.state()
                    self._post(deltas, errors)
                    self._post_stopped(None)
                    return
                if core.has_work():
                    deltas.extend(core.step())
                    errors.extend(core.take_refusals())  # a grammar that failed to compile
                self._snapshot = core.state()
                self._post(deltas, errors)
        except BaseException as exc:  # the loop is dead: every waiting stream fails
            log.exception("engine step loop failed")
            self._crashed = True
            err = EngineDeadError(f"engine step loop failed: {exc!r}")
            err.__cause__ = exc
            self._post_stopped(err)

    def _apply(self, op: AddRequest | _Abort, deltas: list[OutputDelta],
               errors: list[Refusal]) -> None:
        if isinstance(op, _Abort):
            delta = self.core.abort(op.request_id)
            if delta is not None:
                deltas.append(delta)
            return
        try:
            self.core.add_request(op.request_id, op.prompt_token_ids, op.params,
                                  priority=op.priority, cache_salt=op.cache_salt,
                                  arrival_time=op.arrival_time)
        except InvalidRequestError as exc:
            errors.append((op.request_id, exc))

    def _post(self, deltas: list[OutputDelta], errors: list[Refusal]) -> None:
        if (deltas or errors) and self._events is not None:
            self._call_on_loop(self._events.deliver, deltas, errors)

    def _post_stopped(self, error: EngineDeadError | None) -> None:
        if self._events is not None:
            self._call_on_loop(self._events.stopped, error)

    def _call_on_loop(self, fn: Callable[..., None], *args: object) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed between the check and the call
            pass
