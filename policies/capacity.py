"""The capacity gate: what an upstream may have in flight, shared by every gateway replica.

A request holds a *slot* while the upstream works on it: its worst-case tokens (prompt +
max_tokens) and one sequence. ``acquire`` grants a slot only while the upstream's in-flight
worst-case tokens stay within ``cap_tokens`` (its KV token capacity × overcommit) and its
in-flight sequences within ``cap_seqs``; a request bigger than the whole capacity is let
through alone (nothing else in flight), so that it is refused by the model server with a
clear error rather than queued forever. Slots carry a TTL like quota leases (a killed
replica's slots expire) and are renewed by the same loop.

    MemoryGate   one process
    RedisGate    ``sluice:{up:<name>}:slots`` ZSET request id -> expiry µs (Redis TIME),
                 ``sluice:{up:<name>}:tokens`` HASH request id -> tokens, ``_sum`` the total;
                 one Lua script per acquire / release / renew; each one that frees
                 capacity (a release, expired slots swept) SPUBLISHes the count freed on
                 the shard channel ``sluice:{up:<name>}:released`` (same hash tag: same
                 slot), which wakes the other replicas' waiters (``release_events``).
                 Both keys expire a minute past their latest slot's TTL, set by every
                 grant and every renewal that found a slot (not by refusals).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from policies.store import StoreError, ttl_us

if TYPE_CHECKING:  # redis is imported only when a RedisGate is made
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster
    from redis.commands.core import AsyncScript

US = 1_000_000


class CapacityGate(Protocol):
    async def acquire(self, upstream: str, request_id: str, tokens: int,
                      cap_tokens: int | None, cap_seqs: int | None, ttl_s: float) -> bool: ...

    async def release(self, upstream: str, request_id: str) -> bool: ...

    async def renew(self, upstream: str, request_id: str, ttl_s: float) -> bool: ...

    async def renew_many(self, upstream: str, request_ids: Sequence[str],
                         ttl_s: float) -> list[bool]:
        """``renew`` of each id in one step (one round trip): the renewal beat's call."""
        ...

    async def in_flight(self, upstream: str) -> tuple[int, int]:
        """(sequences, worst-case tokens) in flight now."""
        ...


class MemoryGate:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._slots: dict[str, dict[str, tuple[int, int]]] = {}  # up -> rid -> (tokens, exp)

    def _live(self, upstream: str) -> dict[str, tuple[int, int]]:
        now = math.floor(self._clock() * US)
        slots = self._slots.setdefault(upstream, {})
        for rid in [r for r, (_, exp) in slots.items() if exp <= now]:
            del slots[rid]
        return slots

    async def acquire(self, upstream: str, request_id: str, tokens: int,
                      cap_tokens: int | None, cap_seqs: int | None, ttl_s: float) -> bool:
        slots = self._live(upstream)
        if request_id in slots:
            return True
        n = len(slots)
        total = sum(t for t, _ in slots.values())
        if cap_seqs is not None and n >= cap_seqs:
            return False
        if cap_tokens is not None and n > 0 and total + tokens > cap_tokens:
            return False
        slots[request_id] = (tokens, math.floor(self._clock() * US) + ttl_us(ttl_s))
        return True

    async def release(self, upstream: str, request_id: str) -> bool:
        return self._live(upstream).pop(request_id, None) is not None

    async def renew(self, upstream: str, request_id: str, ttl_s: float) -> bool:
        slots = self._live(upstream)
        if request_id not in slots:
            return False
        slots[request_id] = (slots[request_id][0],
                             math.floor(self._clock() * US) + ttl_us(ttl_s))
        return True

    async def renew_many(self, upstream: str, request_ids: Sequence[str],
                         ttl_s: float) -> list[bool]:
        return [await self.renew(upstream, rid, ttl_s) for rid in request_ids]

    async def in_flight(self, upstream: str) -> tuple[int, int]:
        slots = self._live(upstream)
        return len(slots), sum(t for t, _ in slots.values())


_PURGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for _, r in ipairs(expired) do
  local tok = redis.call('HGET', KEYS[2], r)
  if tok then
    redis.call('HINCRBY', KEYS[2], '_sum', -tonumber(tok))
    redis.call('HDEL', KEYS[2], r)
  end
  redis.call('ZREM', KEYS[1], r)
end
local freed = #expired
-- Tell the other replicas' waiters that capacity came back (KEYS[3], a shard channel of the
-- same hash tag, so it lives on this slot's node). pcall: a notification never fails a gate
-- decision; a lost one costs a waiter at most one fallback poll (policies/release_events).
local function told(v)
  if freed > 0 then redis.pcall('SPUBLISH', KEYS[3], tostring(freed)) end
  return v
end
"""
_ACQUIRE = _PURGE + """
local rid, tokens = ARGV[1], tonumber(ARGV[2])
local cap_t, cap_s, ttl = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
if redis.call('ZSCORE', KEYS[1], rid) then return told(1) end
local n = redis.call('ZCARD', KEYS[1])
local sum = tonumber(redis.call('HGET', KEYS[2], '_sum') or '0')
if cap_s >= 0 and n >= cap_s then return told(0) end
if cap_t >= 0 and n > 0 and sum + tokens > cap_t then return told(0) end
redis.call('ZADD', KEYS[1], string.format('%.0f', now + ttl), rid)
redis.call('HSET', KEYS[2], rid, tokens)
redis.call('HINCRBY', KEYS[2], '_sum', tokens)
local keep = math.ceil(ttl / 1000) + 60000
redis.call('PEXPIRE', KEYS[1], keep)
redis.call('PEXPIRE', KEYS[2], keep)
return told(1)
"""
_RELEASE = _PURGE + """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return told(0) end
local tok = redis.call('HGET', KEYS[2], ARGV[1])
if tok then
  redis.call('HINCRBY', KEYS[2], '_sum', -tonumber(tok))
  redis.call('HDEL', KEYS[2], ARGV[1])
end
freed = freed + 1
return told(1)
"""
_RENEW = _PURGE + """
-- ARGV: ttl_us, request_id...: every slot of one replica's beat in one call. A renewal that
-- finds its slot gone frees nothing: whoever removed it (a release, or the sweep of an
-- expired slot) has told already.
-- The two keys outlive their slots by a minute (acquire sets it); a renewal keeps that
-- true, or an upstream kept full past the acquire's TTL (only refusals, no grant since)
-- would lose both keys with slots still held, and the gate would admit a second full set.
local ttl = tonumber(ARGV[1])
local expiry, out, renewed = string.format('%.0f', now + ttl), {}, false
for i = 2, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], 'XX', expiry, ARGV[i])
    out[#out + 1] = 1
    renewed = true
  else
    out[#out + 1] = 0
  end
end
if renewed then
  local keep = math.ceil(ttl / 1000) + 60000
  redis.call('PEXPIRE', KEYS[1], keep)
  redis.call('PEXPIRE', KEYS[2], keep)
end
return told(out)
"""
_IN_FLIGHT = _PURGE + """
return told({redis.call('ZCARD', KEYS[1]), tonumber(redis.call('HGET', KEYS[2], '_sum') or '0')})
"""


class RedisGate:
    """The gate over Redis, sharing the quota store's connection pool."""

    def __init__(self, redis: object, key_prefix: str = "sluice",
                 deadline_s: float = 0.5, *, cluster: bool = False,
                 permits: asyncio.Semaphore | None = None) -> None:
        """``redis`` is the quota store's client (``RedisStore.client``): a Redis, or with
        ``cluster`` a RedisCluster, whose connection bound ``permits`` it shares (each
        script touches only its upstream's ``{up:<name>}`` slot)."""
        from redis.asyncio import Redis
        from redis.asyncio.cluster import RedisCluster

        if not isinstance(redis, RedisCluster if cluster else Redis):
            raise TypeError(f"RedisGate(cluster={cluster}) needs a "
                            f"{'RedisCluster' if cluster else 'Redis'}, not {redis!r}")
        self._redis: Redis | RedisCluster = redis
        self._permits = permits
        self._deadline_s = deadline_s  # the whole call: a pooled connection, the script
        self._prefix = key_prefix
        self._acquire = redis.register_script(_ACQUIRE)
        self._release = redis.register_script(_RELEASE)
        self._renew = redis.register_script(_RENEW)
        self._in_flight = redis.register_script(_IN_FLIGHT)

    @property
    def client(self) -> Redis | RedisCluster:
        """The client the scripts run on (release events subscribe next to it)."""
        return self._redis

    def channel(self, upstream: str) -> str:
        """The shard channel the scripts publish on whenever they free capacity of
        ``upstream`` (a release, or expired slots swept): its keys' hash tag, its slot."""
        return self._keys(upstream)[2]

    def _keys(self, upstream: str) -> list[str]:
        tag = "{up:" + upstream.replace("{", "(").replace("}", ")") + "}"
        return [f"{self._prefix}:{tag}:slots", f"{self._prefix}:{tag}:tokens",
                f"{self._prefix}:{tag}:released"]  # KEYS[3]: a shard channel, not a key

    async def _call(self, script: AsyncScript, upstream: str, args: list[str | int]) -> object:
        from policies.redis_store import guarded

        return await guarded(self._redis, self._deadline_s,
                             script(keys=self._keys(upstream), args=args), self._permits)

    async def acquire(self, upstream: str, request_id: str, tokens: int,
                      cap_tokens: int | None, cap_seqs: int | None, ttl_s: float) -> bool:
        out = await self._call(self._acquire, upstream, [
            request_id, tokens, -1 if cap_tokens is None else cap_tokens,
            -1 if cap_seqs is None else cap_seqs, ttl_us(ttl_s)])
        return bool(out)

    async def release(self, upstream: str, request_id: str) -> bool:
        return bool(await self._call(self._release, upstream, [request_id]))

    async def renew(self, upstream: str, request_id: str, ttl_s: float) -> bool:
        return (await self.renew_many(upstream, [request_id], ttl_s))[0]

    async def renew_many(self, upstream: str, request_ids: Sequence[str],
                         ttl_s: float) -> list[bool]:
        if not request_ids:
            return []
        out = await self._call(self._renew, upstream, [ttl_us(ttl_s), *request_ids])
        if not isinstance(out, list) or len(out) != len(request_ids):
            raise StoreError(f"renew answered {out!r}")
        return [bool(v) for v in out]

    async def in_flight(self, upstream: str) -> tuple[int, int]:
        out = await self._call(self._in_flight, upstream, [])
        if not isinstance(out, list) or len(out) != 2:
            raise StoreError(f"in_flight answered {out!r}")
        return int(out[0]), int(out[1])
