"""How a generation request ended: one vocabulary for the ledger, the metrics and the trace.

``classify`` decides it once, from what the client was told and what the upstream did; the
usage ledger (``requests_settled_total``), ``requests_total`` and the trace's
``sluice.outcome`` all read the same ``Outcome``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from .errors import GatewayError, InternalError
from .relay import RelayResult
from .resolve import Prepared


class Outcome(StrEnum):
    SUCCESS = "success"  # answered in full
    CANCELLED = "cancelled"  # the client left (or stalled) before the answer ended
    REJECTED_429 = "rejected_429"  # a tenant quota or max_queued
    REJECTED_503 = "rejected_503"  # shed: queue full, wait past the deadline, store down
    DEADLINE = "deadline"  # the request's deadline passed (504)
    UPSTREAM_ERROR = "upstream_error"  # the model failed, was unreachable, timed out
    INVALID = "invalid"  # another 4xx: auth, validation, caps, revision mismatch
    ERROR = "error"  # a gateway bug (500)


@dataclass(slots=True, frozen=True)
class Ended:
    """What a generation request leaves for the record, however it ended."""

    outcome: Outcome
    prepared: Prepared | None = None
    reserved: bool = False  # a reservation was granted (and settled)
    queued_s: float | None = None  # time in the gateway's queue, once dispatched
    relay: RelayResult | None = None

    def tokens(self) -> tuple[int, int, bool]:
        """(prompt, completion, exact) tokens the request consumed."""
        if self.relay is None or self.prepared is None:
            return 0, 0, True
        return self.relay.tokens(self.prepared)


_SHED_CODES = frozenset({"overloaded", "store_unavailable", "deadline_unreachable"})


def classify(status: int, error: GatewayError | None, *, accepted: bool = False,
             done: bool = False, upstream_failed: bool = False,
             cancelled: bool = False) -> Outcome:
    """The outcome of a request whose client got ``status`` (0: nothing sent) and ``error``
    (the error it was told, as a response or an in-stream event). ``accepted``: the upstream
    answered 200; ``done``: the whole answer was relayed; ``upstream_failed``: the upstream
    sent an error event inside its stream; ``cancelled``: the client left or stalled."""
    if cancelled and not done:
        return Outcome.CANCELLED
    if done and error is None and not upstream_failed:
        return Outcome.SUCCESS
    if error is not None:
        status = error.status
    code = error.code if error is not None else None
    if status == 429:
        return Outcome.REJECTED_429
    if status == 503 and code in _SHED_CODES:
        return Outcome.REJECTED_503
    if code == "deadline_exceeded":
        return Outcome.DEADLINE
    if status == 500 and isinstance(error, InternalError):
        return Outcome.ERROR
    if accepted or status >= 500:
        return Outcome.UPSTREAM_ERROR
    if status == 0:
        return Outcome.CANCELLED  # the client left before anything was sent
    return Outcome.INVALID


def conclude(status: int, error: GatewayError | None, cancelled: bool,
             prepared: Prepared | None, reserved: bool, queued_s: float | None,
             relay: RelayResult | None) -> Ended:
    """The record of a request whose client got ``status`` / ``error``."""
    outcome = classify(status, error, cancelled=cancelled,
                       accepted=relay is not None and relay.accepted,
                       done=relay is not None and relay.done,
                       upstream_failed=relay is not None and relay.upstream_failed)
    return Ended(outcome, prepared, reserved, queued_s, relay)
