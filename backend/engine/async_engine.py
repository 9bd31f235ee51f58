"""asyncio front of the engine: one stream of outputs per request, over a ``CoreTransport``.

The core steps elsewhere (a worker thread, or an engine process: see ``transport.py``);
``AsyncEngine`` validates a request against the core's limits, hands it to the transport
and gives the caller a ``RequestStream``. The transport delivers each step's outputs on
the event loop, where they go into the streams' queues. Leaving a stream early (break,
exception, task cancellation) aborts the request in the core, which frees its blocks
before its next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Self

from .errors import EngineDeadError, InvalidRequestError
from .grammar import GrammarCompiler
from .limits import RequestLimits
from .outputs import EngineState, OutputDelta
from .sampling import SamplingParams
from .transport import AddRequest, CoreEvents, CoreTransport, EngineInfo, Refusal

if TYPE_CHECKING:
    from .config import EngineConfig
    from .engine import StepHook

log = logging.getLogger("sluice.engine")


class AsyncEngine:
    """The request streams over one engine core.

    ``generate`` returns a ``RequestStream`` of ``OutputDelta`` objects. Engine death (the
    step loop raised, the engine process exited) fails every open stream with
    ``EngineDeadError``, and every later ``generate`` raises it.
    """

    def __init__(self, transport: CoreTransport) -> None:
        self.transport = transport
        self._streams: dict[str, asyncio.Queue[OutputDelta | BaseException]] = {}
        self._dead: EngineDeadError | None = None
        self._stopping = False
        # Called on the event loop with every final delta, also of requests whose stream
        # was closed (a client that left): the server's telemetry ends them there.
        self.on_final: Callable[[OutputDelta], None] | None = None
        # Called once on the event loop when the engine dies while serving (its step loop
        # raised, or its process exited), after every open stream has been failed: `serve`
        # exits then.
        self.on_dead: Callable[[], None] | None = None
        self._grammars: GrammarCompiler | None = None  # checks grammars (built when needed)
        self._grammars_lock = threading.Lock()

    @classmethod
    def from_config(cls, config: EngineConfig, *,
                    step_hook: StepHook | None = None) -> AsyncEngine:
        """Load the model, tokenizer and KV cache that ``config`` names, to step on a
        thread of this process."""
        from .thread_transport import ThreadTransport

        return cls(ThreadTransport.from_config(config, step_hook=step_hook))

    # ---- what the server reads ------------------------------------------------------------
    @property
    def info(self) -> EngineInfo | None:
        return self.transport.info

    @property
    def limits(self) -> RequestLimits:
        return self.transport.limits

    def clock(self) -> float:
        """Now, on the clock of the engine's timestamps (arrival, token and finish times)."""
        return self.transport.clock()

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``InvalidRequestError`` for a request this engine can never serve (a
        grammar is checked here too: a schema it cannot enforce is refused before any
        queue)."""
        self.transport.limits.validate(prompt_token_ids, params)
        if params.grammar is not None:
            self._grammar_checker().check(params.grammar)

    def _grammar_checker(self) -> GrammarCompiler:
        """The server's own compiler, made at the first constrained request (the server
        checks in worker threads: made once under a lock)."""
        with self._grammars_lock:
            if self._grammars is None:
                info = self.transport.info
                if info is None:
                    raise EngineDeadError("engine is not started")
                self._grammars = GrammarCompiler.for_tokenizer(info.tokenizer,
                                                               info.limits.vocab_size)
            return self._grammars

    def state(self) -> EngineState:
        """The snapshot taken after the latest step."""
        return self.transport.state()

    @property
    def is_running(self) -> bool:
        return self.transport.alive and self._dead is None

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        await self.transport.start(CoreEvents(self._deliver, self._stopped))

    async def shutdown(self) -> None:
        """Abort everything still running and stop the core."""
        self._stopping = True
        await self.transport.shutdown()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

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
        if not self.transport.accepting:
            raise EngineDeadError("engine is not started")
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already running",
                                      "request_id")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError("priority must be an integer", "priority")
        self.validate(prompt_token_ids, params)
        queue: asyncio.Queue[OutputDelta | BaseException] = asyncio.Queue()
        self._streams[request_id] = queue
        try:
            self.transport.add(AddRequest(request_id, list(prompt_token_ids), params, priority,
                                          cache_salt, self.clock()))
        except BaseException:
            self._release(request_id)
            raise
        return RequestStream(self, request_id, queue)

    def abort(self, request_id: str) -> None:
        """Ask the core to abort a request (any thread; unknown ids are a no-op)."""
        self.transport.abort(request_id)

    def _release(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # ---- from the transport, on the event loop ------------------------------------------
    def _deliver(self, deltas: list[OutputDelta], errors: list[Refusal]) -> None:
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

    def _stopped(self, error: EngineDeadError | None) -> None:
        if error is not None and self._dead is None:
            self._dead = error
            log.error("%s; failing its %d open request(s)", error, len(self._streams))
        # Every stream still open ends now: after a shutdown each one already has its final
        # (abort) delta and never reads this; if the core died, this is their end. A list:
        # a stream collected on another thread may leave meanwhile.
        err = EngineDeadError(f"engine stopped: {error or 'shut down'}")
        for queue in list(self._streams.values()):
            queue.put_nowait(err)
        if error is not None and not self._stopping:
            hook, self.on_dead = self.on_dead, None
            if hook is not None:
                try:
                    hook()
                except Exception:
                    log.exception("on_dead hook failed")


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
