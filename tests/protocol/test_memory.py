"""Freed heap given back: the Trimmer after large bodies (a background task, counted)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from protocol.memory import Trimmer, release_memory


def test_memory_can_be_released() -> None:
    assert release_memory() in (True, False)  # glibc or not; never raises


async def _until(check: Callable[[], bool]) -> None:
    for _ in range(10_000):
        if check():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never held")


async def test_the_trimmer_trims_after_large_bodies_only() -> None:
    trimmer = Trimmer(min_bytes=1000)
    trimmer.start()
    try:
        if not release_memory():
            pytest.skip("no malloc_trim here (not glibc)")
        trimmer.after(999)
        for _ in range(20):
            await asyncio.sleep(0)
        assert trimmer.trims == 0
        trimmer.after(1000)
        trimmer.after(5000)  # asked twice before it ran: one trim
        await _until(lambda: trimmer.trims >= 1)
        for _ in range(20):
            await asyncio.sleep(0)
        assert trimmer.trims == 1
    finally:
        await trimmer.aclose()
