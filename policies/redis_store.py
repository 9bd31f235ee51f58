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
                                  TTL: 39-40 days past the last write (refreshed
                                  once a day at most: a PTTL read per reserve)
    sluice:{alpha}:leases   ZSET  request id -> expiry µs  (expiry > now: live; = concurrency)
    sluice:{alpha}:starts   ZSET  request id -> reserved-at µs, of each live lease (the
                                  oldest predicts a max_concurrency wait)
    sluice:{alpha}:resv     HASH  request id -> "tokens day month tpm_cap"
                                  TTL of leases, starts, resv: 39-40 days + lease TTL past
                                  the last reserve (renew leaves them)
    sluice:{alpha}:done     ZSET  closed request id -> forget-at µs (settle: lease end +
                                  1 day; expiry: + 1 day); expires with its last member

Invariants: one round trip per reserve / settle, and per renewal of any number of one
tenant's leases (EVALSHA; redis-py's script object
reloads on NOSCRIPT); time is Redis TIME inside Lua, never this host's clock; every Redis
failure or timeout is StoreUnavailable, and no call outlives ~2 x timeout_s.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Sequence
from importlib import resources
from typing import Any, TypeAlias

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError

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


#: A client of one Redis, or of a Redis Cluster (``connect(..., cluster=True)``).
Client: TypeAlias = Redis | RedisCluster


def connect(url: str, timeout_s: float, max_connections: int, *,
            cluster: bool = False) -> Client:
    """A client with Sluice's connection settings, shared by every Redis-backed store.

    A stalled connect or command fails after timeout_s. The pool is bounded: a burst queues
    for a connection (a script takes microseconds) instead of opening hundreds at once. No
    retries: a retried reserve or write could apply twice.

    ``cluster``: ``url`` names one seed node; the client discovers the others (and keeps
    every node it saw as a seed, so a dead first seed does not stop a rediscovery). At most
    ``max_connections`` per node (a cluster node raises instead of queueing when it has no
    free connection: callers queue on ``permits(...)`` first, see ``guarded``). What is
    retried, and why nothing can apply twice:

    - MOVED, ASK, TRYAGAIN, NOSCRIPT: the node refused the command without running it, so
      redis-py follows the redirection (MOVED also refreshes its slot table) and the script
      object loads the script on the new master and calls it again. Always safe.
    - a connection error or a timeout: the command may have run (a reserve whose answer was
      lost). Never retried (``Retry(NoBackoff(), 0)``): the call fails as StoreUnavailable,
      the caller's fail mode decides (and the gateway undoes a reserve that may have
      landed), and redis-py marks the topology for a refresh, so the next call asks the
      cluster who owns the slot now.
    - CLUSTERDOWN, MASTERDOWN, an uncovered slot: not run either, but not retried here: a
      failover takes ~node-timeout seconds, far past one call's deadline; the next call
      (after redis-py's topology refresh) finds the promoted replica.
    """
    if cluster:
        return RedisCluster.from_url(
            url, max_connections=max_connections, socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
            # A slot without a master fails only the tenants on it (CLUSTERDOWN there),
            # never the client, so a partial outage leaves the other masters' tenants be.
            require_full_coverage=False,
            # A MOVED patches that slot only. The default (a full refresh every 5th MOVED)
            # closes every connection of the client, in-flight calls' included: a burst
            # of MOVED after a failover turned into a burst of failed calls.
            reinitialize_steps=0)
    pool = BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=None, socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
    return Redis.from_pool(pool)


def permits(client: Client, max_connections: int) -> asyncio.Semaphore | None:
    """What a call waits on for a connection: a cluster's nodes have no queue (one without a
    free connection raises MaxConnectionsError), so calls queue here, ``max_connections`` at
    once; each call holds at most one connection per node, which keeps every node within
    its bound. None for one Redis, whose pool queues by itself."""
    return asyncio.Semaphore(max_connections) if isinstance(client, RedisCluster) else None


async def guarded(redis: Client, deadline_s: float, call: Any,
                  permits: asyncio.Semaphore | None = None) -> Any:
    """Await a redis-py call within deadline_s (waiting for a pooled connection, or for one
    of ``permits``, included); any failure or overrun becomes StoreUnavailable. Cluster
    errors (CLUSTERDOWN, MASTERDOWN, TRYAGAIN past redis-py's redirections, MOVED past them,
    an uncovered slot, no reachable node) are RedisError or RedisClusterException."""
    try:
        async with asyncio.timeout(deadline_s):
            if isinstance(redis, RedisCluster):
                # Learn the slot table first (a no-op once known): redis-py 8.1 routes a
                # script called before that as keyless, to a random node (MOVED).
                await redis.initialize()
            if permits is None:
                return await call
            async with permits:
                return await call
    except (RedisError, RedisClusterException, OSError, TimeoutError) as exc:
        if isinstance(exc, RedisConnectionError) and isinstance(redis, Redis):
            # The server went away: the other idle connections are stale too; drop them
            # so the next call reconnects instead of failing on one of them. (A cluster
            # client does the same for the failed node and refreshes its topology.)
            with contextlib.suppress(RedisError, OSError):
                await redis.connection_pool.disconnect(inuse_connections=False)
        raise StoreUnavailable(f"redis: {type(exc).__name__}: {exc}") from exc
    finally:
        if inspect.iscoroutine(call) and \
                inspect.getcoroutinestate(call) == inspect.CORO_CREATED:
            call.close()  # the deadline passed while it waited for a permit


async def ping_all(redis: Client) -> None:
    """PING one Redis, or every master of a cluster (each serves some tenants' slots)."""
    if isinstance(redis, RedisCluster):
        await redis.execute_command("PING", target_nodes=RedisCluster.PRIMARIES)
    else:
        await redis.ping()


def lua_source(name: str) -> str:
    """The text of `policies/lua/<name>.lua`."""
    return resources.files("policies").joinpath("lua", f"{name}.lua").read_text("utf-8")


class RedisStore:
    """The shared Store over Redis; see `policies.store` for the contract."""

    def __init__(self, url: str, *, timeout_s: float = 0.25, key_prefix: str = "sluice",
                 max_connections: int = 32, cluster: bool = False) -> None:
        if "{" in key_prefix or "}" in key_prefix:
            raise ValueError("key_prefix must not contain braces (they set the hash tag)")
        self._prefix = key_prefix
        self._deadline_s = 2 * timeout_s  # bounds a whole call (see `guarded`)
        self._redis: Client = connect(url, timeout_s, max_connections, cluster=cluster)
        self._permits = permits(self._redis, max_connections)
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
    def client(self) -> Client:
        """The connection pool's client (the capacity gate shares it)."""
        return self._redis

    @property
    def cluster(self) -> bool:
        return isinstance(self._redis, RedisCluster)

    @property
    def permits(self) -> asyncio.Semaphore | None:
        """The cluster client's connection bound (``permits()``), shared with the gate."""
        return self._permits

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
        return (await self.renew_many(tenant, [request_id], lease_ttl_s))[0]

    async def renew_many(self, tenant: str, request_ids: Sequence[str],
                         lease_ttl_s: float) -> list[bool]:
        if not request_ids:
            return []
        out = await self._run("renew", tenant, ttl_us(lease_ttl_s), *request_ids)
        return [bool(v) for v in out]

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
        await self._guard(ping_all(self._redis))

    async def close(self) -> None:
        await self._redis.aclose()

    async def _run(self, script: str, tenant: str, *args: int | str) -> Any:
        keys = self.keys(tenant)
        return await self._guard(self._scripts[script](keys=keys, args=args))

    async def _guard(self, call: Any) -> Any:
        return await guarded(self._redis, self._deadline_s, call, self._permits)
