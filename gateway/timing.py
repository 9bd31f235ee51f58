"""A request's timestamps as the gateway saw them, and its inter-token gaps."""

from __future__ import annotations

from telemetry.metrics import Observer


class RequestTimes:
    """Monotonic timestamps of one request as the gateway saw it."""

    __slots__ = ("first", "itl", "last", "received")

    def __init__(self, received: float) -> None:
        self.received = received
        self.first: float | None = None  # first content chunk relayed
        self.last: float | None = None  # last content chunk relayed
        self.itl: Observer | None = None  # this request's ITL histogram series

    def chunks(self, n: int, now: float) -> bool:
        """``n`` more content chunks relayed at ``now``; True for the request's first."""
        if n <= 0:
            return False
        first = self.first is None
        itl = self.itl
        if first:
            self.first = now
        elif itl is not None and self.last is not None:
            itl.observe(now - self.last)
        if itl is not None:
            for _ in range(n - 1):  # chunks read together arrived together
                itl.observe(0.0)
        self.last = now
        return first
