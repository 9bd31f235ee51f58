"""The seam between the asyncio front (``AsyncEngine``) and wherever the engine core steps.

``AsyncEngine`` owns the request streams; a ``CoreTransport`` owns the ``LLMEngine`` and
its step loop, and carries requests and aborts to it and its outputs back. Two implement
it, and the front cannot tell them apart:

    ThreadTransport   (thread_transport.py)   the core steps on a worker thread of this
                                              process (tests, ``--engine-in-process``)
    ProcessTransport  (process_transport.py)  the core steps in an engine process of its
                                              own, over a socket (``sluice backend``)

What the server reads of the core never reaches into it: ``EngineInfo`` (fixed when the
engine is built: tokenizer, versions, sizes, the ``RequestLimits`` that validate a request),
the transport's ``clock`` (the engine's timestamps are on it) and ``state()`` (the latest
snapshot, taken after every step).

Contract of a transport, checked by tests/backend/engine/test_transport.py over a fake:
- ``start(events)`` is awaited on the event loop; from then on every output reaches
  ``events.deliver`` on that loop, in step order, and ``events.stopped`` is called exactly
  once, after the last output: with None when ``shutdown`` stopped the core, with an
  ``EngineDeadError`` when the core died (its step loop raised, its process exited).
- ``add`` is called on the loop and raises ``EngineDeadError`` when nothing can take the
  request; an add the core refuses comes back as an error in ``deliver``.
- ``abort`` is safe from any thread and a no-op for unknown, finished or dead requests.
- ``shutdown`` aborts whatever still runs (its final deltas are delivered) and returns
  once the core has stopped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from .errors import EngineDeadError
from .limits import RequestLimits
from .outputs import EngineState, OutputDelta
from .sampling import SamplingParams

if TYPE_CHECKING:
    from modelfiles.tokenizer import Tokenizer
    from protocol.versions import ResolvedVersions


@dataclass(slots=True, frozen=True)
class EngineInfo:
    """What the server reads of an engine, fixed when it is built."""

    tokenizer: Tokenizer
    versions: ResolvedVersions
    model_name: str
    model_path: Path
    device: str  # "cpu", "cuda:0"
    dtype: str  # "bfloat16"
    num_blocks: int
    kv_bytes_per_block: int
    limits: RequestLimits
    pid: int  # the process whose thread steps the engine


@dataclass(slots=True, frozen=True)
class AddRequest:
    """A request for the core, validated against its ``RequestLimits``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    arrival_time: float  # on the transport's clock


# An add the core refused, by request id (InvalidRequestError and its kind).
Refusal = tuple[str, Exception]


@dataclass(slots=True, frozen=True)
class CoreEvents:
    """Where a transport reports, always on the event loop it was started on."""

    deliver: Callable[[list[OutputDelta], list[Refusal]], None]
    stopped: Callable[[EngineDeadError | None], None]


class CoreTransport(Protocol):
    """An engine core stepping elsewhere (a thread, a process), seen from the event loop."""

    @property
    def info(self) -> EngineInfo | None:
        """None only for a bare core handed in by a test (no model files behind it)."""

    @property
    def limits(self) -> RequestLimits: ...

    def clock(self) -> float:
        """Now, on the clock of the engine's timestamps."""

    @property
    def accepting(self) -> bool:
        """Started, not shutting down, not dead: ``add`` may be called."""

    @property
    def alive(self) -> bool:
        """The core is up (also while it shuts down: its final deltas are still due)."""

    async def start(self, events: CoreEvents) -> None: ...

    async def shutdown(self) -> None: ...

    def add(self, request: AddRequest) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def state(self) -> EngineState: ...
