"""asyncio front of the engine: the model step runs on a worker thread, never on the loop.

Requests and aborts are queued to the worker and applied between two steps, so an abort
frees the request's blocks before the next forward pass. Each request's output reaches
its caller through an ``asyncio.Queue`` filled with one ``call_soon_threadsafe`` per step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

from .engine import LLMEngine
from .errors import EngineDeadError, InvalidRequestError
from .outputs import EngineState, OutputDelta
from .sampling import SamplingParams

if TYPE_CHECKING:
    from .builder import EngineParts

log = logging.getLogger("sluice.engine")


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    arrival_time: float


@dataclass(slots=True)
class _Abort:
    request_id: str


class AsyncEngine:
    """Drive an ``LLMEngine`` from asyncio.

    ``generate`` yields ``OutputDelta`` objects; leaving the iteration early (break,
    exception, task cancellation) aborts the request in the engine.
    """

    def __init__(self, core: LLMEngine, parts: EngineParts | None = None) -> None:
        self.core = core
        self.parts = parts
        self._cv = threading.Condition()
        self._ops: list[_Add | _Abort] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, asyncio.Queue[OutputDelta | BaseException]] = {}
        self._dead: BaseException | None = None
        self._snapshot: EngineState = core.state()
        # Called on the event loop with every final delta, also of requests whose stream
        # was closed (a client that left): the server's telemetry ends them there.
        self.on_final: Callable[[OutputDelta], None] | None = None
        # Called once on the event loop when the engine dies (its step loop raised, or its
        # process exited), after every open stream has been failed: `serve` exits then.
        self.on_dead: Callable[[], None] | None = None

    @classmethod
    def from_config(cls, config: Any) -> AsyncEngine:
        """Load the model, tokenizer and KV cache that ``config`` (EngineConfig) names."""
        from .builder import build_engine

        parts = build_engine(config)
        return cls(parts.core, parts)

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="sluice-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Abort everything still running and stop the worker."""
        if self._thread is None:
            return
        with self._cv:
            self._stopping = True
            self._cv.notify()
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._dead is None

    # ---- requests -----------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Start a request and return its output stream. Invalid input raises here,
        before anything is queued."""
        if self._dead is not None:
            raise EngineDeadError("engine step loop has failed") from self._dead
        if not self._accepting():
            raise EngineDeadError("engine is not started")
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already running",
                                      "request_id")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError("priority must be an integer", "priority")
        self.core.validate(prompt_token_ids, params)  # reads only immutable settings
        queue: asyncio.Queue[OutputDelta | BaseException] = asyncio.Queue()
        self._streams[request_id] = queue
        self._submit(_Add(request_id, list(prompt_token_ids), params, priority, cache_salt,
                          self.core.clock()))
        return RequestStream(self, request_id, queue)

    def _accepting(self) -> bool:
        return self._thread is not None and self._loop is not None

    def _release(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Ask the worker to abort a request (thread-safe; unknown ids are a no-op)."""
        self.core.mark_abort(request_id)
        self._submit(_Abort(request_id))

    def state(self) -> EngineState:
        """The snapshot taken after the latest step or queued operation."""
        return self._snapshot

    def _submit(self, op: _Add | _Abort) -> None:
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
                errors: list[tuple[str, BaseException]] = []
                for op in ops:
                    self._apply(op, deltas, errors)
                if stopping:
                    deltas.extend(core.abort_all())
                    self._snapshot = core.state()
                    self._publish(deltas, errors)
                    return
                if core.has_work():
                    deltas.extend(core.step())
                self._snapshot = core.state()
                self._publish(deltas, errors)
        except BaseException as exc:  # the loop is dead: fail every waiting stream
            log.exception("engine step loop failed")
            self._dead = exc
            self._fail_all(exc)

    def _apply(self, op: _Add | _Abort, deltas: list[OutputDelta],
               errors: list[tuple[str, BaseException]]) -> None:
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

    def _publish(self, deltas: list[OutputDelta],
                 errors: list[tuple[str, BaseException]]) -> None:
        if (deltas or errors) and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._dispatch, deltas, errors)
            except RuntimeError:  # loop closed between the check and the call
                pass

    def _dispatch(self, deltas: list[OutputDelta],
                  errors: list[tuple[str, BaseException]]) -> None:
        on_final = self.on_final
        for delta in deltas:
            queue = self._streams.get(delta.request_id)
            if queue is not None:
                queue.put_nowait(delta)
            if delta.finished and on_final is not None:
                try:
                    on_final(delta)
                except Exception:  # telemetry must never break the stream of outputs
                    log.exception("on_final hook failed for %s", delta.request_id)
        for rid, exc in errors:
            queue = self._streams.get(rid)
            if queue is not None:
                queue.put_nowait(exc)

    def _notify_dead(self) -> None:
        hook, self.on_dead = self.on_dead, None
        if hook is not None:
            try:
                hook()
            except Exception:
                log.exception("on_dead hook failed")

    def _fail_all(self, exc: BaseException) -> None:
        if self._loop is None or self._loop.is_closed():
            return
        err = EngineDeadError(f"engine step loop failed: {exc!r}")

        def fail() -> None:
            for queue in list(self._streams.values()):
                queue.put_nowait(err)
            self._notify_dead()

        try:
            self._loop.call_soon_threadsafe(fail)
        except RuntimeError:
            pass


class RequestStream:
    """Async iterator over one request's ``OutputDelta`` objects.

    Closing it (``aclose()``, ``async with``), or cancelling a task while it waits for
    the next delta, aborts the request unless it already finished — also when iteration
    never started, which a plain async generator would not guarantee.
    """

    __slots__ = ("_done", "_engine", "_queue", "request_id")

    def __init__(self, engine: AsyncEngine, request_id: str,
                 queue: asyncio.Queue[OutputDelta | BaseException]) -> None:
        self._engine = engine
        self.request_id = request_id
        self._queue = queue
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> OutputDelta:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            self._finish()
            raise item
        if item.finished:
            self._finish()
        return item

    async def aclose(self) -> None:
        if not self._done:
            self._finish()
            self._engine.abort(self.request_id)

    def _finish(self) -> None:
        self._done = True
        self._engine._release(self.request_id)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        # Last resort for a stream dropped without closing: never leave it running.
        if not self._done:
            self._done = True
            try:
                self._engine._release(self.request_id)
                self._engine.abort(self.request_id)
            except Exception:  # noqa: BLE001, S110 - interpreter shutdown
                pass
