"""The slots one replica holds at an upstream's capacity gate, in asyncio.

``policies.capacity`` is the gate (in memory, or in Redis and shared by the replicas); this
is one replica's side of it, for one upstream's ``DispatchQueue``: the caps a request of a
given priority may fill (``Reserve``), the gate each held slot is on, and

  * no gate round trip for an upstream of unknown capacity (``UNGATED``);
  * a local fail-open gate while the shared one is unreachable (this replica's share of
    the capacity, for tenants that fail open; the others get a 503);
  * the undo of an acquire that timed out, as it may still land in Redis;
  * releases in tasks this owns, so a cancelled request cannot cancel its own release;
  * renewals of the slots' TTLs (a killed replica's slots expire).

Every slot taken or given back is recorded in the queue's ``FairQueue`` in the same step
(held tokens, the drain estimate), so both hold the same ids at every await
(``DispatchQueue.check_invariants`` checks it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from policies.capacity import CapacityGate, MemoryGate
from policies.fair_queue import DEFAULT_RETRY_S, FairQueue, Reserve
from policies.store import RENEW_BATCH, StoreError, StoreUnavailable

from .errors import ServiceUnavailable

log = logging.getLogger("sluice.gateway.queue")  # the queue's log: these are its slots

UNDO_AGAIN_S = 1.0  # a second try at undoing a timed-out slot acquire (it may land late)

Limits = Callable[[], tuple[int | None, int | None]]  # (cap_tokens, cap_seqs) now
UNGATED: CapacityGate = MemoryGate()  # marks slots of an upstream without capacity limits


class HeldSlots:
    """The slots this replica holds on one upstream (request id -> the gate it is on)."""

    def __init__(self, upstream: str, gate: CapacityGate, limits: Limits, reserve: Reserve,
                 policy: FairQueue, freed: Callable[[], None], *, ttl_s: float,
                 replicas: int) -> None:
        self.upstream = upstream
        self.gate = gate
        # While the shared gate is unreachable, fail-open tenants use this replica's share.
        self.local_gate = MemoryGate()
        self.limits = limits
        self.reserve = reserve
        self.policy = policy
        self.freed = freed  # called once a slot is back at its gate: waiters may fit now
        self.ttl_s = ttl_s
        self.replicas = replicas
        self._gates: dict[str, CapacityGate] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._gates)

    def __iter__(self) -> Iterator[str]:
        return iter(self._gates)

    async def acquire(self, request_id: str, tokens: int, priority: int,
                      fail_open: bool) -> bool:
        """Ask the gate for a slot within the caps of ``priority``; False: no room now.
        Raises ServiceUnavailable while the gate is unreachable, unless ``fail_open``."""
        cap_tokens, cap_seqs = self.reserve.caps(priority, *self.limits())
        if cap_tokens is None and cap_seqs is None:
            # An upstream of unknown capacity has no gate: no store round trip to make.
            self._grant(request_id, tokens, UNGATED)
            return True
        gate: CapacityGate = self.gate
        try:
            ok = await gate.acquire(self.upstream, request_id, tokens, cap_tokens, cap_seqs,
                                    self.ttl_s)
        except StoreUnavailable as exc:
            self._undo_lost(request_id)
            if not fail_open:
                raise ServiceUnavailable("the capacity gate is unreachable",
                                         retry_after_s=DEFAULT_RETRY_S,
                                         code="store_unavailable") from exc
            gate = self.local_gate
            ok = await gate.acquire(self.upstream, request_id, tokens,
                                    _share(cap_tokens, self.replicas),
                                    _share(cap_seqs, self.replicas), self.ttl_s)
        if ok:
            self._grant(request_id, tokens, gate)
        return ok

    def release(self, request_id: str, tokens: int) -> None:
        """Give a slot back (idempotent); ``tokens`` count as drained (0: unused)."""
        if request_id in self._gates:
            self._own(self._give_back(request_id, tokens))

    async def renew_all(self) -> None:
        """Every held slot renewed: one gate call per ``RENEW_BATCH`` slots of a gate (a
        thousand streams: four round trips a beat, not a thousand in a row)."""
        by_gate: dict[int, tuple[CapacityGate, list[str]]] = {}
        for rid, gate in list(self._gates.items()):
            if gate is not UNGATED:
                by_gate.setdefault(id(gate), (gate, []))[1].append(rid)
        for gate, ids in by_gate.values():
            for i in range(0, len(ids), RENEW_BATCH):
                try:
                    await gate.renew_many(self.upstream, ids[i:i + RENEW_BATCH], self.ttl_s)
                except StoreUnavailable:
                    pass  # the slots' TTL covers a few missed beats
                except StoreError as exc:  # an answer it did not expect: the next batch
                    log.warning("renewing %d slots of %s failed: %s",  # may still do
                                len(ids[i:i + RENEW_BATCH]), self.upstream, exc)

    async def aclose(self) -> None:
        """Wait (a while) for the releases and undos under way."""
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5.0)

    def _grant(self, request_id: str, tokens: int, gate: CapacityGate) -> None:
        self._gates[request_id] = gate
        self.policy.grant(request_id, tokens)

    async def _give_back(self, request_id: str, tokens: int) -> None:
        gate = self._gates.pop(request_id, None)
        if gate is None:
            return
        self.policy.release(request_id, tokens)
        if gate is UNGATED:
            self.freed()
            return
        try:
            await gate.release(self.upstream, request_id)
        except StoreUnavailable:
            log.warning("releasing slot %s of %s failed; it expires in %.0f s", request_id,
                        self.upstream, self.ttl_s)
        self.freed()

    def _undo_lost(self, request_id: str) -> None:
        """An acquire that timed out may still have taken the slot in Redis (slow, not
        down): release it now and once more later, as it may land late (a no-op if it never
        landed), in a task this owns."""
        async def undo() -> None:
            for wait in (0.0, UNDO_AGAIN_S):
                await asyncio.sleep(wait)
                if self._gates.get(request_id) is self.gate:
                    return  # granted since (a retry of the same id): the slot is in use
                with contextlib.suppress(StoreUnavailable):
                    if await self.gate.release(self.upstream, request_id):
                        return

        self._own(undo())

    def _own(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _share(cap: int | None, replicas: int) -> int | None:
    return None if cap is None else max(1, cap // replicas)
