"""How long a client may take to send a request, and how many connections a listener keeps.

Both servers take these (the gateway from ``gateway.yaml``, the backend from its flags) and
hand them to ``protocol.server.http_protocol``, which enforces them under uvicorn. This
module imports nothing heavy: the ``sluice`` parser reads the defaults.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

DEFAULT_REQUEST_READ_S = 10.0
DEFAULT_BODY_MIN_BYTES_PER_S = 64 * 1024
DEFAULT_MAX_CONNECTIONS = 4096  # the gateway's listener (clients)
# The backend's listener: its clients are the gateways, each holding up to its
# models[].max_connections (1024) pooled connections to it: 15 such replicas fit with room
# to spare (docs/deploy.md#connection-budgets; at 4096, 4 replicas filled it). At start
# the soft open-file limit is raised to this + 1024 (fit_file_limit), which common hard
# limits (Docker's and systemd's 524288 or more) allow. Under a lower hard limit the cap is
# never reached: past `ulimit -n` accept() fails instead (a warning says so at start).
DEFAULT_BACKEND_MAX_CONNECTIONS = 16384
# A request head larger than this is refused with 431 (uvicorn's httptools parser takes any
# size: a 13 MB header line was buffered whole). Real heads are a few KiB; nginx's default
# allows 4 × 8 KiB lines.
MAX_HEAD_BYTES = 64 * 1024
# What a chunked body may carry after its last payload byte: its trailer lines (kept by
# uvicorn in the request's headers) and its framing. More gets 431 like a head.
MAX_TRAILER_BYTES = 64 * 1024


class Cut(enum.Enum):
    """Why the HTTP layer cut a request or refused it (the ``reason`` of the servers'
    ``connections_cut_total``; docs/metrics.md)."""

    HEAD_TIMEOUT = "head_timeout"  # 408: the head did not arrive within request_read_s
    BODY_TIMEOUT = "body_timeout"  # 408 (or a close, the answer started): body too slow
    HEAD_TOO_LARGE = "head_too_large"  # 431
    TRAILERS_TOO_LARGE = "trailers_too_large"  # 431: past MAX_TRAILER_BYTES
    TOO_MANY_CONNECTIONS = "too_many_connections"  # 503: past max_connections
    BAD_REQUEST = "bad_request"  # 400: bytes that are not HTTP/1.1
    IDLE = "idle"  # closed without an answer: no request byte within request_read_s


class ConnectionCounts:
    """One listener's cuts and refusals by ``Cut``: its protocol adds, its /metrics reads
    ``snapshot()``. Both run on the server's event loop."""

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts = dict.fromkeys(Cut, 0)

    def add(self, cut: Cut) -> int:
        """Counts one ``cut``; how many there have been."""
        self._counts[cut] += 1
        return self._counts[cut]

    def snapshot(self) -> tuple[tuple[str, int], ...]:
        """(reason, count) for every ``Cut``, zeros included, in ``Cut``'s order."""
        return tuple((cut.value, n) for cut, n in self._counts.items())


@dataclass(slots=True, frozen=True)
class ConnectionLimits:
    """The rules a client connection lives by (docs/resilience.md#slow-senders).

    - Its request head (request line + headers) must be complete within ``request_read_s``
      of the connection's start (first request) or of the request's first byte (later ones);
      otherwise 408 and close.
    - Its body must keep pace: ``t`` seconds after the head, at least
      ``(t - request_read_s) × body_min_bytes_per_s`` bytes must have arrived. So a body of
      S bytes arrives within ``request_read_s + S / body_min_bytes_per_s``, and no prefix of
      it lags that schedule; otherwise 408 (JSON) if no answer has started, else close.
      Time the server itself holds the body back (flow control, ``Expect: 100-continue``
      before the app reads) is not counted.
    - At most ``max_connections`` connections are open on the listener; one more is answered
      503 (``too_many_connections``, Retry-After) as soon as its head has arrived, then closed.
    - Sizes (not settings): a head of at most ``MAX_HEAD_BYTES``, and at most
      ``MAX_TRAILER_BYTES`` after a chunked body's last payload byte; else 431.
    """

    request_read_s: float = DEFAULT_REQUEST_READ_S
    body_min_bytes_per_s: int = DEFAULT_BODY_MIN_BYTES_PER_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    def __post_init__(self) -> None:
        if not (math.isfinite(self.request_read_s) and self.request_read_s > 0):
            raise ValueError("request_read_s must be a positive number of seconds")
        if self.body_min_bytes_per_s < 1:
            raise ValueError("body_min_bytes_per_s must be at least 1")
        if self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")
