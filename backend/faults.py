"""Fault injection for the bundled backend, injected at the composition root.

The engine knows nothing of faults: it runs an optional step hook before the model in
every step that runs the model (``LLMEngine(step_hook=...)``). ``sluice backend
--fault-step-delay MS`` builds a ``StepDelay`` and hands it to the engine's builder, so a
slow or overloaded model server can be played for resilience tests and demos.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

MAX_STEP_DELAY_S = 60.0


@dataclass(slots=True, frozen=True)
class StepDelay:
    """A step hook that sleeps ``seconds`` (counted as model time). Plain data, so it
    pickles: the engine process runs it, not the server."""

    seconds: float

    def __post_init__(self) -> None:
        if not 0 < self.seconds <= MAX_STEP_DELAY_S:
            raise ValueError(f"a step delay must be in (0, {MAX_STEP_DELAY_S:g}] seconds, "
                             f"got {self.seconds:g}")

    def __call__(self) -> None:
        time.sleep(self.seconds)


def step_delay_hook(delay_ms: float) -> StepDelay | None:
    """The hook for ``--fault-step-delay MS``: None for 0 (no fault), else a
    ``StepDelay``. Raises ValueError outside [0, 60000] ms."""
    if delay_ms == 0:
        return None
    if not 0 < delay_ms <= MAX_STEP_DELAY_S * 1000:
        raise ValueError(f"--fault-step-delay must be in [0, {MAX_STEP_DELAY_S * 1000:g}] ms, "
                         f"got {delay_ms:g}")
    return StepDelay(delay_ms / 1000)
