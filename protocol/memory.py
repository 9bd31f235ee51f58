"""Giving freed heap memory back to the system after large requests.

glibc keeps the pages a process has freed for its own later use: after a 3.8 MB body has
been parsed and refused, or a large prompt tokenized (its encoding is ~350 MiB), the
server's RSS stays up, and a few such requests add hundreds of MiB that are never given
back. ``release_memory`` asks glibc to return them (``malloc_trim``, where there is one).

Two callers: a tokenize worker after a job of ``trim_chars`` or more (``protocol.offload``),
and ``Trimmer``, after a request with a large body has ended. docs/gateway.md#memory has
the measurements.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
from collections.abc import Callable


class Trimmer:
    """Gives freed heap memory back after requests with a large body (``min_bytes`` or
    more): glibc may keep the pages of a 3.8 MB body and what was parsed from it otherwise.
    A request only asks (``after``, once it is done with its body); one background task,
    started and stopped with the server, trims in a thread (``malloc_trim`` runs without the
    GIL), once for however many requests asked meanwhile. ``trims`` counts the trims done
    (the servers' ``/metrics``)."""

    def __init__(self, min_bytes: int = 1 << 20) -> None:
        self.min_bytes = min_bytes
        self.trims = 0
        self._wanted = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def after(self, nbytes: int) -> None:
        """A request that had ``nbytes`` of body has ended."""
        if nbytes >= self.min_bytes:
            self._wanted.set()

    def start(self) -> None:
        if self._task is None and _malloc_trim() is not None:
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            await asyncio.to_thread(release_memory)
            self.trims += 1

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols: libc's, on Linux
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS)
        return None
    return trim


def release_memory() -> bool:
    """Hand freed heap pages back to the system (glibc ``malloc_trim``); ctypes releases
    the GIL for the call. False where there is no such call."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
