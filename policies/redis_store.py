"""RedisStore: the quota store shared by gateway replicas, one Lua script per decision.

Key layout (prefix "sluice", tenant "alpha"); `{alpha}` is a Redis Cluster hash tag, so
one tenant's keys share a slot, and every script declares all six in KEYS:

    sluice:{alpha}:bucket   HASH  tpm_lvl tpm_ts tpm_cap  rpm_lvl rpm_ts rpm_cap
                                  (levels in micro-units, times in µs of Redis TIME)
                                  TTL: 1 min past the time both buckets are full again
    sluice:{alpha}:budget   HASH  d:20250314:r  reserved tokens   of that UTC day
                                  d:20250314:u  used (settled) tokens
                                  d:20250314:n  granted requests
                                  d:20250314:x:<limit>  rejects by limit
                                  m:202503:r / m:202503:u   the same per UTC month
                                  day           last day seen (prunes on a new day:
                                                days kept 3, months kept 2)
                                  hold_mean hold_dev  µs a request holds its lease,
                                                smoothed (policies/hold.py)
                                  TTL: 40 days past the last write
    sluice:{alpha}:leases   ZSET  request id -> expiry µs  (expiry > now: live; = concurrency)
    sluice:{alpha}:starts   ZSET  request id -> reserved-at µs, of each live lease (the
                                  oldest predicts a max_concurrency wait)
    sluice:{alpha}:resv     HASH  request id -> "tokens day month tpm_cap"
                                  TTL of leases, starts, resv: 40 days + lease TTL past
                                  the last write
    sluice:{alpha}:done     ZSET  closed request id -> forget-at µs (settle: lease end +
                                  1 day; expiry: + 1 day); expires with its last member

Invariants: one round trip per reserve / renew / settle (EVALSHA; redis-py's script object
reloads on NOSCRIPT); time is Redis TIME inside Lua, never this host's clock; every Redis
failure or timeout is StoreUnavailable, and no call outlives ~2 x timeout_s.
"""

from __future__ import annotations

import asyncio
import contextlib
from importlib import resources
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from policies.periods import US
from policies.quotas import Decision, Quotas, RateHeaders
from policies.store import (
    DuplicateRequest,
    StoreUnavailable,
    Usage,
    check_tenant,
    check_tokens,
    ttl_us,
)

_KEYS = ("bucket", "budget", "leases", "resv", "done", "starts")


def connect(url: str, timeout_s: float, max_connections: int) -> Redis:
    """A client with Sluice's connection settings, shared by every Redis-backed store.

    A stalled connect or command fails after timeout_s. The pool is bounded: a burst queues
    for a connection (a script takes microseconds) instead of opening hundreds at once. No
    retries: a retried reserve or write could apply twice.
    """
    pool = BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=None, socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
    return Redis.from_pool(pool)


async def guarded(redis: Redis, deadline_s: float, call: Any) -> Any:
    """Await a redis-py call within deadline_s (waiting for a pooled connection included);
    any failure or overrun becomes StoreUnavailable."""
    try:
        async with asyncio.timeout(deadline_s):
            return await call
    except (RedisError, OSError, TimeoutError) as exc:
        if isinstance(exc, RedisConnectionError):
            # The server went away: the other idle connections are stale too; drop them
            # so the next call reconnects instead of failing on one of them.
            with contextlib.suppress(RedisError, OSError):
                await redis.connection_pool.disconnect(inuse_connections=False)
        raise StoreUnavailable(f"redis: {type(exc).__name__}: {exc}") from exc


def lua_source(name: str) -> str:
    """The text of `policies/lua/<name>.lua`."""
    return resources.files("policies").joinpath("lua", f"{name}.lua").read_text("utf-8")


class RedisStore:
    """The shared Store over Redis; see `policies.store` for the contract."""

    def __init__(self, url: str, *, timeout_s: float = 0.25, key_prefix: str = "sluice",
                 max_connections: int = 32) -> None:
        if "{" in key_prefix or "}" in key_prefix:
            raise ValueError("key_prefix must not contain braces (they set the hash tag)")
        self._prefix = key_prefix
        self._deadline_s = 2 * timeout_s  # bounds a whole call (see `guarded`)
        self._redis: Redis = connect(url, timeout_s, max_connections)
        lib = lua_source("lib")
        self._scripts: dict[str, AsyncScript] = {
            name: self._redis.register_script(lib + "\n" + lua_source(name))
            for name in ("reserve", "renew", "settle", "usage", "concurrency")
        }

    @property
    def deadline_s(self) -> float:
        """The bound on one whole call (waiting for a connection included)."""
        return self._deadline_s

    @property
    def client(self) -> Redis:
        """The connection pool's client (the capacity gate shares it)."""
        return self._redis

    def keys(self, tenant: str) -> list[str]:
        """The tenant's keys, in the order every script takes them."""
        check_tenant(tenant)
        return [f"{self._prefix}:{{{tenant}}}:{k}" for k in _KEYS]

    async def reserve(self, tenant: str, request_id: str, tokens: int, quotas: Quotas,
                      lease_ttl_s: float) -> Decision:
        check_tokens(tokens)
        limits = (quotas.tokens_per_minute, quotas.requests_per_minute, quotas.tokens_per_day,
                  quotas.tokens_per_month, quotas.max_concurrency)
        out = await self._run("reserve", tenant, request_id, tokens, ttl_us(lease_ttl_s),
                              *(-1 if v is None else v for v in limits))
        if out[0] == -1:
            raise DuplicateRequest(f"request {request_id!r} of {tenant!r} was reserved before")
        granted, denied_by, retry, rrem, rreset, trem, treset = out
        rate = RateHeaders(
            limit_requests=quotas.requests_per_minute,
            remaining_requests=None if rrem < 0 else int(rrem),
            reset_requests_s=None if rreset < 0 else rreset / US,
            limit_tokens=quotas.tokens_per_minute,
            remaining_tokens=None if trem < 0 else int(trem),
            reset_tokens_s=None if treset < 0 else treset / US,
        )
        return Decision(granted=granted == 1, denied_by=denied_by.decode() or None,
                        retry_after_s=None if granted or retry < 0 else retry / US, rate=rate)

    async def renew(self, tenant: str, request_id: str, lease_ttl_s: float) -> bool:
        return bool(await self._run("renew", tenant, request_id, ttl_us(lease_ttl_s)))

    async def settle(self, tenant: str, request_id: str, actual_tokens: int) -> bool:
        check_tokens(actual_tokens)
        return bool(await self._run("settle", tenant, request_id, actual_tokens))

    async def usage(self, tenant: str) -> Usage:
        out = await self._run("usage", tenant)
        rday, rmonth, uday, umonth, nday, live, minute = out[:7]
        reserved = {"day": rday, "month": rmonth}
        if minute >= 0:
            reserved["minute"] = minute
        return {"reserved": reserved,
                "settled": {"day": uday, "month": umonth},
                "requests": {"day": nday},
                "concurrency": live,
                "rejects": {out[i].decode(): out[i + 1] for i in range(7, len(out), 2)}}

    async def concurrency(self, tenant: str) -> int:
        return int(await self._run("concurrency", tenant))

    async def ping(self) -> None:
        await self._guard(self._redis.ping())

    async def close(self) -> None:
        await self._redis.aclose()

    async def _run(self, script: str, tenant: str, *args: int | str) -> Any:
        keys = self.keys(tenant)
        return await self._guard(self._scripts[script](keys=keys, args=args))

    async def _guard(self, call: Any) -> Any:
        return await guarded(self._redis, self._deadline_s, call)
