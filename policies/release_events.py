"""Release events: a replica hears at once when another one frees capacity at the gate.

The gate's scripts (``policies.capacity.RedisGate``) SPUBLISH on the shard channel
``sluice:{up:<name>}:released`` whenever they free capacity of an upstream (a release, or
expired slots swept). ``ReleaseEvents`` SSUBSCRIBEs to the channels of the upstreams this
process queues for and calls each one's wake callback when a message arrives, so a waiter
on replica B is granted a slot one round trip after replica A released it, instead of at
B's next poll of the gate.

Pub/sub delivers at most once: a message published while a link is down (or dropped by an
output-buffer limit) is lost for good. So events only shorten the wait, never carry it.
While a channel is subscribed its queue still polls the gate, less often (the fallback);
while it is not (``hears()`` is False: not yet confirmed, reconnecting) the queue polls as
often as it did before events existed. A link that comes (back) up wakes its queues once,
for whatever it missed while down.

Links, one dedicated connection each (never one of the store's pooled connections, which a
subscribed connection would hold for good):

    one Redis    one link for every channel
    a cluster    one link per channel, to the node that owns the channel's slot (from the
                 cluster client's slot map, or from the MOVED answer to an SSUBSCRIBE);
                 re-resolved on every reconnect, and when the node unsubscribes us (the
                 slot migrated away). A link that fails re-reads the slot map (through the
                 client, skipping the failed node) before it backs off, so after a
                 failover it finds the promoted replica once the cluster has promoted it.

A link that fails (connection killed, node gone, no answer to a keepalive PING within
``2 x keepalive_s``) closes its connection and retries after a jittered exponential backoff
(``backoff_s``). ``aclose`` cancels and awaits every link task and closes its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import MovedError, RedisClusterException, RedisError

log = logging.getLogger("sluice.policies.release_events")

Wake = Callable[[], None]


class _Lost(Exception):
    """The node stopped serving a channel of the link (an unsolicited SUNSUBSCRIBE)."""


@dataclass(slots=True, frozen=True)
class ReleaseEventsSnapshot:
    channels: int  # channels this process listens to
    subscribed: int  # of which confirmed subscribed now
    messages: int  # release messages heard since the start
    reconnects: int  # links re-opened after a failure


class ReleaseEvents:
    """Wake the queue of an upstream when the gate tells that its capacity came back."""

    def __init__(self, client: Redis | RedisCluster, channels: Mapping[str, str],
                 wakes: Mapping[str, Wake], *, keepalive_s: float = 5.0,
                 backoff_s: tuple[float, float] = (0.05, 2.0),
                 rng: Callable[[], float] = random.random) -> None:
        """``channels``: upstream -> its channel (``RedisGate.channel``); ``wakes``:
        upstream -> the callback of its queue."""
        self._client = client
        self._channels = dict(channels)
        self._wakes: dict[str, list[Wake]] = {}
        for up, wake in wakes.items():
            self._wakes.setdefault(channels[up], []).append(wake)
        self._keepalive_s = keepalive_s
        self._backoff_s = backoff_s
        self._rng = rng
        self._subscribed: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self.messages = 0
        self.reconnects = 0

    def hears(self, upstream: str) -> bool:
        """Whether a release of ``upstream``'s capacity would reach its queue now."""
        return self._channels.get(upstream) in self._subscribed

    def snapshot(self) -> ReleaseEventsSnapshot:
        return ReleaseEventsSnapshot(len(self._channels), len(self._subscribed),
                                     self.messages, self.reconnects)

    def start(self) -> None:
        """One link task per connection (see the module docstring), on the running loop."""
        if self._tasks:
            return
        channels = sorted(set(self._channels.values()))
        groups = [[c] for c in channels] if isinstance(self._client, RedisCluster) \
            else [channels]
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._link(g), name=f"release-events:{g[0]}")
                       for g in groups if g]

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self._subscribed.clear()

    # ---- one link -------------------------------------------------------------------------
    def _pool(self, channel: str, moved: tuple[str, int] | None) -> ConnectionPool:
        """A one-connection pool to the node serving ``channel`` (or where MOVED said)."""
        client = self._client
        if isinstance(client, RedisCluster):
            node = client.get_node_from_key(channel)
            if node is None:
                raise RedisClusterException(f"no node serves the slot of {channel!r}")
            kwargs = dict(node.connection_kwargs, host=node.host, port=node.port)
            cls: type[AbstractConnection] = node.connection_class
        else:
            kwargs = dict(client.connection_pool.connection_kwargs)
            cls = client.connection_pool.connection_class
        if moved is not None:
            kwargs.update(host=moved[0], port=moved[1])
        # failures surface here (and back off), not in redis-py's silent reconnects
        kwargs.update(retry=Retry(NoBackoff(), 0), health_check_interval=0)
        return ConnectionPool(connection_class=cls, max_connections=1, **kwargs)

    async def _link(self, channels: list[str]) -> None:
        failures = 0
        moved: tuple[str, int] | None = None
        while True:
            pool: ConnectionPool | None = None
            pubsub: PubSub | None = None
            failed: str | None = None  # the node that failed us, if it did
            try:
                pool = self._pool(channels[0], moved)
                pubsub = PubSub(pool)
                for channel in channels:  # one call each: a cluster refuses CROSSSLOT
                    await pubsub.ssubscribe(channel)
                await self._listen(pubsub, channels)
            except MovedError as exc:  # the slot lives elsewhere: go there
                moved = (exc.host, exc.port)
                log.info("release events of %s: moved to %s:%s", channels[0], *moved)
            except (RedisError, RedisClusterException, OSError, _Lost) as exc:
                moved = None
                failures += 1
                log.warning("release events of %s lost (%s: %s); polling the gate meanwhile",
                            channels[0], type(exc).__name__, exc)
                kw = pool.connection_kwargs if pool is not None else {}
                failed = f"{kw.get('host')}:{kw.get('port')}"
            except Exception:  # a bug, or an answer nobody expected: the link lives on
                moved = None
                failures += 1
                log.exception("release events of %s failed; polling the gate meanwhile",
                              channels[0])
            finally:
                heard = self._subscribed & set(channels)
                self._subscribed.difference_update(channels)
                if heard:
                    failures = min(failures, 1)  # it worked a while: start the backoff over
                await _close(pubsub, pool)
            if failed is not None:
                await self._refresh(failed)
            self.reconnects += 1
            await asyncio.sleep(self._backoff(failures))

    async def _listen(self, pubsub: PubSub, channels: list[str]) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            msg = await pubsub.get_message(timeout=self._keepalive_s)
            now = loop.time()
            if msg is None:
                if now - last > 2 * self._keepalive_s:
                    raise ConnectionError("no answer to the keepalive PING")
                await pubsub.ping()
                continue
            last = now
            kind, channel = msg["type"], msg["channel"]
            if isinstance(kind, bytes):
                kind = kind.decode()
            if isinstance(channel, bytes):
                channel = channel.decode()
            if kind == "smessage":
                self.messages += 1
                self._wake(channel)
            elif kind == "ssubscribe":
                self._subscribed.add(channel)
                self._wake(channel)  # whatever was released while we were not listening
            elif kind == "sunsubscribe":
                raise _Lost(f"the node unsubscribed {channel!r} (its slot moved)")

    async def _refresh(self, failed: str) -> None:
        """A cluster: re-read the slot map (the node may have failed over), asking the
        ``failed`` node last; shared with the client's own refreshes (one at a time)."""
        client = self._client
        if not isinstance(client, RedisCluster):
            return
        with contextlib.suppress(RedisError, RedisClusterException, OSError, TimeoutError):
            async with asyncio.timeout(self._keepalive_s):
                await client.nodes_manager.initialize(last_failed_node_name=failed)

    def _wake(self, channel: str) -> None:
        for wake in self._wakes.get(channel, ()):
            wake()

    def _backoff(self, failures: int) -> float:
        """Jittered exponential: base x 2^(failures-1), at most the cap, x [0.5, 1)."""
        base, cap = self._backoff_s
        return float(min(cap, base * 2 ** max(failures - 1, 0)) * (0.5 + self._rng() / 2))


async def _close(pubsub: PubSub | None, pool: ConnectionPool | None) -> None:
    """Close a link's connection; never raises (the link is being given up anyway)."""
    with contextlib.suppress(RedisError, OSError, RuntimeError):
        if pubsub is not None:
            await pubsub.aclose()  # type: ignore[no-untyped-call]
        if pool is not None:
            await pool.aclose()
