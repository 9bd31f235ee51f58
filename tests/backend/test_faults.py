"""Fault injection as an injected step hook (``backend/faults.py``): the CLI's
``--fault-step-delay`` builds a ``StepDelay``; the engine only runs "a hook"."""

from __future__ import annotations

import asyncio
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import pytest

from backend.engine.async_engine import AsyncEngine
from backend.engine.config import EngineConfig
from backend.engine.process_transport import ProcessTransport
from backend.engine.sampling import SamplingParams
from backend.faults import StepDelay, step_delay_hook


def test_the_flag_builds_a_delay_hook_or_none() -> None:
    assert step_delay_hook(0) is None
    assert step_delay_hook(2.5) == StepDelay(0.0025)
    assert step_delay_hook(60_000) == StepDelay(60.0)
    for bad in (-1, 60_001, float("nan")):
        with pytest.raises(ValueError, match="--fault-step-delay"):
            step_delay_hook(bad)
    with pytest.raises(ValueError):
        StepDelay(0)


def test_a_step_delay_sleeps_its_seconds_and_pickles(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr("backend.faults.time.sleep", slept.append)
    hook = StepDelay(0.02)
    hook()
    assert slept == [0.02]
    assert pickle.loads(pickle.dumps(hook)) == hook  # it crosses to the engine process


@dataclass(frozen=True)
class MarkStep:
    """A step hook that appends the process id to a file: it pickles by reference to this
    module, which the engine process imports (the repository root is on its path)."""

    path: str

    def __call__(self) -> None:
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


async def test_the_hook_runs_in_the_engine_process_once_per_model_step(
        tiny_cache_dir: Path, tmp_path: Path) -> None:
    marks = tmp_path / "steps"
    config = EngineConfig(model="tiny", cache_dir=str(tiny_cache_dir), num_threads=1)
    transport = await asyncio.to_thread(ProcessTransport.from_config, config,
                                        step_hook=MarkStep(str(marks)))
    async with AsyncEngine(transport) as engine:
        stream = await engine.generate("a", [5, 6, 7], SamplingParams(
            max_tokens=4, temperature=0.0, ignore_eos=True))
        assert [d.num_output_tokens async for d in stream][-1] == 4
        steps = engine.state().steps
        pid = transport.info.pid
    lines = marks.read_text().split()
    assert steps == 4 and lines == [str(pid)] * 4 and pid != os.getpid()
