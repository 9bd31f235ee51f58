"""HTTP connections for the load client: one single-connection httpx client per request in
flight, instead of one shared pool.

httpcore's pool (1.0.x) scans every one of its connections each time a request starts and
each time a response closes (encode/httpcore#1035), so with N connections every request
costs O(N) of client CPU: a closed loop at N = 64 against an instant upstream spent three
quarters of its time there and reached a quarter of the open-loop rate (`python -m
loadtest.ceiling`, docs/loadtest.md). N pools of one connection cost O(1) each. The clients
share one SSL context (building one per client loads the CA bundle every time, ~25 ms).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque
from collections.abc import AsyncIterator

import httpx

ONE = httpx.Limits(max_connections=1, max_keepalive_connections=1)


class Lender:
    """Lends single-connection clients, at most ``cap`` at once (a request beyond that waits
    for one to come back, and its dispatch lag shows it). Idle ones are kept for reuse
    (their connection stays open: keep-alive, as one pool would)."""

    def __init__(self, cap: int) -> None:
        self._idle: deque[httpx.AsyncClient] = deque()
        self._all: list[httpx.AsyncClient] = []
        self._slots = asyncio.Semaphore(cap)
        self._ssl = ssl.create_default_context()

    def dedicated(self) -> httpx.AsyncClient:
        """A client of its own (a closed-loop slot, or one more to lend), closed with the
        others."""
        client = httpx.AsyncClient(limits=ONE, timeout=httpx.Timeout(None), verify=self._ssl)
        self._all.append(client)
        return client

    @contextlib.asynccontextmanager
    async def lend(self) -> AsyncIterator[httpx.AsyncClient]:
        async with self._slots:
            client = self._idle.pop() if self._idle else self.dedicated()
            try:
                yield client
            finally:
                self._idle.append(client)

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self._all), return_exceptions=True)
        self._all.clear()
        self._idle.clear()
