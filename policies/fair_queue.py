"""The dispatch policy of one upstream's queue: order, fair share, aging, shedding, drain.

Pure Python: no asyncio, no I/O, one injected clock. ``gateway/queue.py`` wraps it with the
futures, the pump and the capacity gate; this module decides *who* goes next, *whether* a
request may wait at all, and *how long* it would wait.

Order. The class of a waiting request is ``priority - floor(waited / aging_s)`` (lower is
more urgent), so low priority eventually runs. Within the most urgent class, the tenant with
the least *virtual time* goes first (then the earliest arrival); a dispatch advances its
tenant's virtual time by ``1 / weight``, and a tenant that starts waiting starts at the
least virtual time of those waiting (no credit banked while idle): one tenant flooding
cannot starve another of the same class, which gets its weighted share of dispatches.

Why it is right (the order; the reserve below is strict priority by design).
  * No starvation: every request ages at the same rate, so a request E of priority p that
    arrived at t0 is strictly more urgent, from then on, than any request arriving after
    ``t0 + (p - p_min + 1) * aging_s`` (p_min the most urgent priority in use). Only those
    waiting when E arrived and those arriving within that window can go before it.
  * Weighted share: while tenants i and j stay backlogged in the same class, the pick takes
    the least of ``v = dispatched / weight``, so after every dispatch
    ``v_i - 1/w_i <= v_j``: each gets ``w_i / sum(w)`` of the dispatches, within one.
  * A tenant's entries of one priority wait in one FIFO; its head is never less urgent
    than the entries behind it (same priority, earlier arrival), so looking at the heads
    only is enough.

Shedding, at enqueue (``shed``):
    queue full (``max_len``) or the tenant's ``max_queued``      503 / 429
    predicted wait > the request's deadline                      503
    the deadline passes while waiting                            504 (the wrapper's timer)
with ``predicted wait = worst-case tokens waiting ahead (this request's class or more
urgent, plus its own) / drain rate``, the drain rate being the worst-case tokens of slots
released per second over the last ``DRAIN_WINDOW_S`` (or since the first slot, if sooner,
but never over less than 1 s). Before any slot was released there is no rate, and no
request is shed by prediction. Retry-After is that predicted wait (``DEFAULT_RETRY_S``
without a rate).

Reserve for urgent work (``Reserve``, off by default). A request with a priority above
``Reserve.priority`` (batch) starts only while the upstream's in-flight sequences and
worst-case tokens, its own included, stay within ``1 - share`` of the capacity; urgent
requests may use all of it. Without a reserve, long batch generations can hold every slot,
and an interactive request waits for one of them to finish however urgent it is. The check
is on the upstream's total (one atomic gate call, shared by replicas), so while urgent work
alone fills more than the batch share, batch waits: strict priority, as in the queue's
order; aging moves a batch request ahead of other batch, never into the reserve.

State (``check_invariants`` checks it):
    waiting     (tenant, priority) -> FIFO of Entry; no empty FIFO; ``size`` entries in all
    per_tenant  tenant -> its entries waiting (sums to ``size``)
    vtime       tenant -> virtual time, set for every tenant that ever waited
    dispatched  tenant -> entries dispatched (a counter)
    slots       request id -> worst-case tokens of a slot held now
    drained     (time, tokens) of slots released, oldest first (pruned to the window)
and running totals of the waiting, held and drained tokens (a snapshot per request is O(1)).
"""

from __future__ import annotations

import collections
import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

DRAIN_WINDOW_S = 10.0
DEFAULT_RETRY_S = 1.0  # Retry-After while there is no drain rate yet
MIN_RETRY_S = 0.001

Clock = Callable[[], float]


@dataclass(slots=True, frozen=True)
class Reserve:
    """Capacity kept for urgent work: batch (priority > ``priority``) gets ``1 - share``."""
    share: float = 0.0
    priority: int = 0

    def urgent(self, priority: int) -> bool:
        """Whether a request of this priority may use the reserve."""
        return priority <= self.priority

    def caps(self, priority: int, cap_tokens: int | None,
             cap_seqs: int | None) -> tuple[int | None, int | None]:
        """The capacity a request of this priority may fill, its own included."""
        if not self.share or self.urgent(priority):
            return cap_tokens, cap_seqs
        return _less(cap_tokens, self.share), _less(cap_seqs, self.share)


def _less(cap: int | None, share: float) -> int | None:
    """What is left of a capacity for batch work once the reserve is set aside."""
    return None if cap is None else max(1, math.floor(cap * (1 - share)))


@dataclass(slots=True, eq=False)
class Entry:
    """One waiting request (compared by identity)."""
    request_id: str
    tenant: str
    weight: float
    priority: int
    tokens: int  # worst case: prompt + max output
    arrival: float


class ShedReason(enum.Enum):
    FULL = "full"  # the queue holds max_len requests
    MAX_QUEUED = "max_queued"  # the tenant has max_queued requests waiting
    DEADLINE = "deadline"  # arrival + predicted wait > deadline


@dataclass(slots=True, frozen=True)
class Shed:
    reason: ShedReason
    retry_after_s: float
    predicted_wait_s: float | None


class FairQueue:
    """Waiting requests, the slots held, and the releases of the last window."""

    def __init__(self, *, max_len: int, aging_s: float, clock: Clock,
                 drain_window_s: float = DRAIN_WINDOW_S) -> None:
        if max_len < 0 or aging_s <= 0 or drain_window_s <= 0:
            raise ValueError("max_len must be >= 0, aging_s and drain_window_s > 0")
        self.max_len = max_len
        self.aging_s = aging_s
        self.drain_window_s = drain_window_s
        self.clock = clock
        self._waiting: dict[tuple[str, int], collections.deque[Entry]] = {}
        self._size = 0
        self._per_tenant: dict[str, int] = {}
        self._vtime: dict[str, float] = {}
        self._dispatched: dict[str, int] = {}
        self._slots: dict[str, int] = {}
        self._drained: collections.deque[tuple[float, int]] = collections.deque()
        self._waiting_tokens = 0
        self._held_tokens = 0
        self._drained_tokens = 0
        self._first_slot: float | None = None

    # ---- read-only views ------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self._size

    @property
    def waiting(self) -> Mapping[tuple[str, int], Sequence[Entry]]:
        return self._waiting

    @property
    def vtime(self) -> Mapping[str, float]:
        return self._vtime

    @property
    def dispatched(self) -> Mapping[str, int]:
        return self._dispatched

    @property
    def slots(self) -> Mapping[str, int]:
        return self._slots

    @property
    def held_tokens(self) -> int:
        return self._held_tokens

    @property
    def waiting_tokens(self) -> int:
        return self._waiting_tokens

    def waiting_of(self, tenant: str) -> int:
        return self._per_tenant.get(tenant, 0)

    def urgency(self, entry: Entry, now: float) -> int:
        """The entry's class now: priority minus one per ``aging_s`` waited."""
        return entry.priority - math.floor((now - entry.arrival) / self.aging_s)

    # ---- waiting --------------------------------------------------------------------------
    def shed(self, tenant: str, priority: int, tokens: int, max_queued: int | None,
             deadline: float | None, arrival: float) -> Shed | None:
        """Why a request arriving at ``arrival`` may not wait, or None if it may."""
        wait = self.predicted_wait(priority, tokens)
        retry = DEFAULT_RETRY_S if wait is None else max(wait, MIN_RETRY_S)
        if self._size >= self.max_len:
            return Shed(ShedReason.FULL, retry, wait)
        if max_queued is not None and self.waiting_of(tenant) >= max_queued:
            return Shed(ShedReason.MAX_QUEUED, retry, wait)
        if deadline is not None and wait is not None and arrival + wait > deadline:
            return Shed(ShedReason.DEADLINE, retry, wait)
        return None

    def push(self, request_id: str, tenant: str, weight: float, priority: int, tokens: int,
             arrival: float) -> Entry:
        """Start waiting (``shed`` is the caller's to ask first)."""
        if weight <= 0:
            raise ValueError("weight must be > 0")
        if not self._per_tenant.get(tenant):
            # A tenant that starts waiting starts level with those waiting: no banked credit.
            active = [self._vtime[t] for t, n in self._per_tenant.items() if n]
            self._vtime[tenant] = max(self._vtime.get(tenant, 0.0), min(active, default=0.0))
        entry = Entry(request_id, tenant, weight, priority, tokens, arrival)
        self._waiting.setdefault((tenant, priority), collections.deque()).append(entry)
        self._size += 1
        self._waiting_tokens += tokens
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
        return entry

    def remove(self, entry: Entry) -> bool:
        """Stop waiting; False if it was not waiting (idempotent)."""
        key = (entry.tenant, entry.priority)
        q = self._waiting.get(key)
        if q is None:
            return False
        try:
            q.remove(entry)
        except ValueError:
            return False
        self._size -= 1
        self._waiting_tokens -= entry.tokens
        self._per_tenant[entry.tenant] -= 1
        if not q:
            del self._waiting[key]
        return True

    def pick(self, eligible: Callable[[Entry], bool] | None = None) -> Entry | None:
        """The entry to dispatch next among the eligible FIFO heads: least (class, virtual
        time, arrival); ties go to the FIFO that started waiting first."""
        now = self.clock()
        best: tuple[int, float, float] | None = None
        chosen: Entry | None = None
        for q in self._waiting.values():
            head = q[0]
            if eligible is not None and not eligible(head):
                continue
            key = (self.urgency(head, now), self._vtime.get(head.tenant, 0.0), head.arrival)
            if best is None or key < best:
                best, chosen = key, head
        return chosen

    def dispatch(self, entry: Entry) -> None:
        """The entry got its slot: it stops waiting and its tenant pays ``1 / weight``."""
        self.remove(entry)
        self._vtime[entry.tenant] = self._vtime.get(entry.tenant, 0.0) + 1.0 / entry.weight
        self._dispatched[entry.tenant] = self._dispatched.get(entry.tenant, 0) + 1

    # ---- slots and the drain estimate -----------------------------------------------------
    def grant(self, request_id: str, tokens: int) -> None:
        """A slot of ``tokens`` worst-case tokens is held for the request."""
        self._held_tokens += tokens - self._slots.get(request_id, 0)
        self._slots[request_id] = tokens
        if self._first_slot is None:
            self._first_slot = self.clock()

    def release(self, request_id: str, tokens: int) -> bool:
        """The slot is given back; ``tokens`` count as drained (0: given back unused).
        False if no slot was held (idempotent)."""
        held = self._slots.pop(request_id, None)
        if held is None:
            return False
        self._held_tokens -= held
        self._drained.append((self.clock(), tokens))
        self._drained_tokens += tokens
        return True

    def drain_rate(self) -> float | None:
        """Worst-case tokens released per second lately; None before any were."""
        now = self.clock()
        while self._drained and self._drained[0][0] < now - self.drain_window_s:
            self._drained_tokens -= self._drained.popleft()[1]
        if not self._drained or self._first_slot is None:
            return None
        # released over the window, or over the time since slots were first handed out
        span = max(min(now - self._first_slot, self.drain_window_s), 1.0)
        released = self._drained_tokens
        return released / span if released > 0 else None  # slots given back unused: no rate

    def predicted_wait(self, priority: int, tokens: int) -> float | None:
        """Seconds until a request arriving now would be dispatched; None without a rate."""
        rate = self.drain_rate()
        if rate is None:
            return None
        now = self.clock()
        ahead = sum(e.tokens for q in self._waiting.values() for e in q
                    if self.urgency(e, now) <= priority)
        return (ahead + tokens) / rate

    # ---- checks ---------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the counts, FIFOs and clocks disagree."""
        counts: dict[str, int] = {}
        seen: set[int] = set()
        for (tenant, priority), q in self._waiting.items():
            if not q:
                raise AssertionError(f"empty FIFO left for {(tenant, priority)}")
            for e in q:
                if (e.tenant, e.priority) != (tenant, priority):
                    raise AssertionError(f"{e.request_id} filed under {(tenant, priority)}")
                if id(e) in seen:
                    raise AssertionError(f"{e.request_id} waits twice")
                seen.add(id(e))
                counts[tenant] = counts.get(tenant, 0) + 1
                if tenant not in self._vtime:
                    raise AssertionError(f"tenant {tenant} waits without a virtual time")
        if len(seen) != self._size:
            raise AssertionError(f"size {self._size} but {len(seen)} entries wait")
        if self._waiting_tokens != sum(e.tokens for q in self._waiting.values() for e in q):
            raise AssertionError("the waiting tokens' total disagrees with the entries")
        if self._held_tokens != sum(self._slots.values()):
            raise AssertionError("the held tokens' total disagrees with the slots")
        if self._drained_tokens != sum(n for _, n in self._drained):
            raise AssertionError("the drained tokens' total disagrees with the releases")
        live = {t: n for t, n in self._per_tenant.items() if n}
        if live != counts or any(n < 0 for n in self._per_tenant.values()):
            raise AssertionError(f"per-tenant counts {live} but {counts} wait")
        if any(v < 0 or not math.isfinite(v) for v in self._vtime.values()):
            raise AssertionError("a virtual time is negative or not finite")
        if any(n < 0 for n in self._dispatched.values()):
            raise AssertionError("a negative dispatch count")
        if any(t < 0 for t in self._slots.values()):
            raise AssertionError("a slot of negative tokens")
        if (self._slots or self._drained) and self._first_slot is None:
            raise AssertionError("slots held or released, but none was ever granted")
        times = [t for t, _ in self._drained]
        if times != sorted(times) or any(n < 0 for _, n in self._drained):
            raise AssertionError("releases out of order or negative")
