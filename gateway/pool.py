"""The servers behind one public model, and which of them takes the next request.

A model's ``upstreams:`` list (or its single ``upstream:``) becomes ``Member``s: each with
its own keep-alive connections, circuit breaker, capacity (its own ``/v1/state`` for the
bundled backend) and dispatch queue (``Gateway.queues[member.key]``), so the capacity gate
applies to each member on its own.

Each member knows the versions it serves (``Member.versions``: read from its own
``/v1/models`` by the upstream's refresh, or the config's for an ``openai`` server; None
while unknown). A pinned request (``model: "name@revision"``) is routed only among the
members whose known revision matches the pin; ``NoRevision`` when none does.

Routing (``Router.pick``), among the members whose breaker lets a request through (one
still inside the Retry-After it answered with is taken only when no other can):
    least_load  the fewest in-flight worst-case tokens per unit of weight (this replica's);
    prefix      rendezvous hashing of (tenant, the prompt's first ``prefix_chars``) over the
                members, taking the first in hash order whose in-flight requests stay
                within ⌈``load_bound`` × the average⌉ (consistent hashing with bounded
                loads), so
                requests sharing a prefix meet the same prefix cache, and a hot prefix
                spills over instead of overloading one server.
The prefix key reads characters, not tokens: the hash needs the same start to give the same
key, which characters do without tokenizing twice.

A member whose breaker just went half-open → closed is paced by its ``Ramp``
(policies/breaker.py) for ``ramp_s``: while its ramp has no room it comes after the others
(with those inside a Retry-After), so least-load routing cannot hand it every new request
at once; it is still taken when no other member can (its capacity gate bounds it then).
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from policies.breaker import Breaker, BreakerPolicy, Pass, Ramp, State
from protocol.versions import ResolvedVersions, ServedVersions

from .config import MemberEntry, ModelEntry
from .http_client import Pool

log = logging.getLogger("sluice.gateway.pool")

_STAMPS_KEPT = 1024  # stamps per member (one per tenant policy) before starting again


class Member:
    """One server of a model's pool."""

    def __init__(self, model: str, key: str, entry: MemberEntry, pool: Pool,
                 policy: BreakerPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        self.key = key  # the queue and capacity-gate name: the model's name for a lone server
        self.url = entry.url
        self.kind = entry.kind or "openai"
        self.weight = entry.weight
        self.pool = pool
        self.clock = clock
        self.breaker = Breaker(policy, clock, self._transition)
        self.ramp: Ramp | None = None  # pacing after half-open → closed; None when unpaced
        self.kv_tokens: int | None = None
        self.max_seqs: int | None = None
        self.overcommit = 1.0
        self.inflight_tokens = 0  # worst-case tokens this replica has sent here, not ended
        self.inflight_requests = 0
        self.not_before = 0.0  # its Retry-After: no new request before this clock time
        self.last_error: str | None = None
        # What this server serves, as last read (None: unknown, so never given a pin). The
        # object is replaced only when the versions change: stamps are cached by identity.
        self.versions: ServedVersions | None = None
        # its own x-sluice-resolved, as its /v1/models answered alongside ``versions``
        # (None when that did not agree with them): an answer naming the same is theirs
        self.reported_header: str | None = None
        self._stamps: dict[str | None, ResolvedVersions] = {}

    def serves(self, pin: str) -> bool:
        """Whether this member's known revision matches ``pin``."""
        v = self.versions
        return v is not None and v.revision_matches(pin)

    def stamp(self, policy: str | None) -> ResolvedVersions | None:
        """This member's versions as an answer's stamp (None while unknown); one per tenant
        policy while the versions stay, so the fingerprint is hashed once."""
        v = self.versions
        if v is None:
            return None
        stamp = self._stamps.get(policy)
        if stamp is None or stamp.versions is not v:
            if len(self._stamps) >= _STAMPS_KEPT:
                self._stamps.clear()
            stamp = self._stamps[policy] = ResolvedVersions(self.model, v, policy)
        return stamp

    def _transition(self, old: State, new: State) -> None:
        log.warning("model %s: upstream %s breaker %s -> %s", self.model, self.url, old, new)
        self.ramp = None
        p = self.breaker.policy
        if old == "half_open" and new == "closed" and p.ramp_s > 0:
            try:
                self.ramp = Ramp(p.ramp_s, p.ramp_start_rps)
            except RuntimeError:  # no event loop (a synchronous caller): nothing to pace
                pass

    def paced(self) -> bool:
        """Whether its ramp holds it back now (no room for one more request)."""
        ramp = self.ramp
        if ramp is None:
            return False
        if ramp.over():
            self.ramp = None
            return False
        return not ramp.has_room()

    def dispatched(self) -> None:
        """Count one request routed here against its ramp, if it has one."""
        if self.ramp is not None:
            self.ramp.take()

    def limits(self) -> tuple[int | None, int | None]:
        """(in-flight worst-case tokens, in-flight sequences) its capacity gate allows."""
        kv = self.kv_tokens
        return (None if kv is None else max(1, int(kv * self.overcommit)), self.max_seqs)

    def load(self) -> float:
        return self.inflight_tokens / self.weight


def build_members(entry: ModelEntry, pools: Sequence[Pool], policy: BreakerPolicy,
                  clock: Callable[[], float] = time.monotonic) -> list[Member]:
    specs = entry.members
    lone = len(specs) == 1
    out = []
    for i, (spec, pool) in enumerate(zip(specs, pools, strict=True)):
        m = Member(entry.name, entry.name if lone else f"{entry.name}#{i}", spec, pool,
                   policy, clock)
        m.kv_tokens, m.max_seqs = entry.capacity.kv_tokens, entry.capacity.max_seqs
        m.overcommit = entry.overcommit
        out.append(m)
    return out


class AllOpen(Exception):
    """No member can take a request now; ``retry_after_s`` until the first one may."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"every upstream is unavailable for {retry_after_s:.3f} s")
        self.retry_after_s = retry_after_s


class NoRevision(AllOpen):
    """No member is known to serve the pinned revision; ``retry_after_s`` is the refresh
    interval, the soonest the gateway can learn that one does."""


class Router:
    def __init__(self, entry: ModelEntry, members: list[Member],
                 refresh_s: float = 10.0) -> None:
        self.members = members
        self.refresh_s = refresh_s  # how often members' versions are re-read
        self.mode = entry.routing
        self.prefix_chars = entry.prefix_chars
        self.load_bound = entry.load_bound
        self.routed: dict[str, int] = {m.key: 0 for m in members}

    def prefix_key(self, tenant: str, payload: Any) -> bytes | None:
        """What the prefix hash reads: the tenant and the prompt's first characters."""
        if self.mode != "prefix" or len(self.members) < 2:
            return None
        if isinstance(payload, list):  # chat messages: their text, in order
            text = "".join(str(m.get("content", "")) if isinstance(m, dict) else str(m)
                           for m in payload)
        else:
            text = str(payload)
        return tenant.encode() + b"\0" + text[:self.prefix_chars].encode()

    def pick(self, tokens: int, key: bytes | None = None,
             exclude: frozenset[str] = frozenset(),
             pin: str | None = None) -> tuple[Member, Pass]:
        """A member (serving ``pin``, when given) and its breaker's pass; raises
        ``NoRevision`` when no member serves the pin, ``AllOpen`` when none can take it."""
        members = self.serving(pin)
        for m in self._order(members, tokens, key, exclude):
            granted = m.breaker.try_pass()
            if granted is not None:
                self.routed[m.key] += 1
                m.dispatched()
                return m, granted
        if not members:
            raise NoRevision(self.refresh_s)
        raise AllOpen(self.retry_after(exclude, members))

    def serving(self, pin: str | None) -> list[Member]:
        """The members a request pinned to ``pin`` may go to (all of them when unpinned)."""
        if pin is None:
            return self.members
        return [m for m in self.members if m.serves(pin)]

    def retry_after(self, exclude: frozenset[str] = frozenset(),
                    members: list[Member] | None = None) -> float:
        waits = [m.breaker.remaining_cooldown() for m in members or self.members
                 if m.key not in exclude]
        return max(min(waits, default=1.0), 0.001)

    def _order(self, members: list[Member], tokens: int, key: bytes | None,
               exclude: frozenset[str]) -> list[Member]:
        """Candidates, best first; a member paced by its ramp comes after those, and one
        inside its Retry-After last of all."""
        live = [m for m in members if m.key not in exclude and m.breaker.available()]
        now = self.members[0].clock()
        later = ([m for m in live if m.not_before <= now and m.paced()]
                 + [m for m in live if m.not_before > now])
        live = [m for m in live if m.not_before <= now and m not in later]
        if len(live) < 2:
            return live + later
        by_load = sorted(live, key=lambda m: (m.load(), self.routed[m.key]))  # ties: turns
        if key is None:
            return by_load + later
        ranked = sorted(live, key=lambda m: _score(key, m.key), reverse=True)
        # the bound in requests, rounded up (Mirrokni et al.): at low load a member may
        # take a few requests past the exact average, or a shared prefix would spill
        # on every request that found its member busy
        total = sum(m.inflight_requests for m in live) + 1
        weight = sum(m.weight for m in live)
        fits = [m for m in ranked if m.inflight_requests + 1
                <= math.ceil(self.load_bound * total * m.weight / weight)]
        return fits + [m for m in by_load if m not in fits] + later


def _score(key: bytes, member: str) -> int:
    digest = hashlib.blake2b(key + b"\0" + member.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
