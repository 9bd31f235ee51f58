"""A real Redis Cluster on 127.0.0.1 for tests: 3 masters + 3 replicas, started, killed,
restarted and stopped by PID.

    LocalCluster(tmp).start()   six `redis-server --cluster-enabled yes` on free ports, joined
                                by `redis-cli --cluster create … --cluster-replicas 1`;
                                returns once every node says cluster_state:ok
    .url                        a seed node's URL (what `store.url` names)
    .topology()                 every live node's view: port, id, role, its master, its slots
    .master_for(key)            the node serving a key's slot now
    .kill(node) / .restart(node)  SIGKILL by PID; the same port and nodes.conf again
    .wait_ok(…)                 poll (with a deadline) until the live nodes agree it is whole
    .stop()                     SIGTERM (SIGKILL past 10 s) every node it started

``redis_cluster`` is the session's shared cluster. Import it where a module needs it; every
import reuses the one cluster (kept in ``config.stash``), stopped once at the session's end.
A test that kills a node must leave the cluster whole again (``restart`` + ``wait_ok``), or
use a ``LocalCluster`` of its own (tests/resilience/test_cluster_failover.py does).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from policies.redis_child import stop_by_pid

NODE_TIMEOUT_MS = 1000  # a master is failed (and its replica promoted) ~1-3 s after it dies


@dataclass(frozen=True)
class NodeInfo:
    """One node as the cluster sees it (CLUSTER NODES)."""

    port: int
    id: str
    role: str                 # "master" | "replica"
    master_id: str | None     # a replica's master
    slots: tuple[tuple[int, int], ...]  # ranges a master serves
    failed: bool              # flagged fail (or pfail) by the node asked

    def serves(self, slot: int) -> bool:
        return any(lo <= slot <= hi for lo, hi in self.slots)


class Node:
    """One `redis-server --cluster-enabled yes` child process."""

    def __init__(self, workdir: Path, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}"
        self._workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (`make test` installs it)")
        log = open(self._workdir / f"redis-{self.port}.log", "ab")  # noqa: SIM115
        with log:
            self.proc = subprocess.Popen(
                [binary, "--port", str(self.port), "--bind", "127.0.0.1",
                 "--cluster-enabled", "yes",
                 "--cluster-config-file", str(self._workdir / f"nodes-{self.port}.conf"),
                 "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                 # as Sluice asks of a production cluster (docs/admission.md): a master being
                 # failed over stops only its own slots, not every slot of the cluster
                 "--cluster-require-full-coverage", "no",
                 # a replica's first sync starts at once, not 5 s later: a replica that
                 # never synced refuses to be promoted ("disconnected for too long")
                 "--repl-diskless-sync-delay", "0",
                 "--save", "", "--appendonly", "no", "--dir", str(self._workdir)],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on {self.port} exited: see {log.name}")
            try:
                if self.client().ping():
                    return
            except redis.RedisError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def client(self) -> redis.Redis:
        """A plain connection to this node alone (never redirected)."""
        return redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1,
                           decode_responses=True)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no goodbye to the cluster."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.alive:
            assert self.proc is not None
            stop_by_pid(self.proc)
        self.proc = None


class LocalCluster:
    def __init__(self, workdir: Path, masters: int = 3) -> None:
        self._workdir = workdir
        ports: list[int] = []
        while len(ports) < 2 * masters:
            port = _free_node_port()
            if port not in ports:
                ports.append(port)
        self.nodes = [Node(workdir, port) for port in ports]

    @property
    def url(self) -> str:
        """A seed: the first node still alive (redis-py finds the others from it)."""
        return next(n for n in self.nodes if n.alive).url

    def start(self) -> LocalCluster:
        try:
            for n in self.nodes:
                n.start()
            cli = shutil.which("redis-cli")
            if cli is None:
                raise RuntimeError("redis-cli is not installed")
            out = subprocess.run(
                [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                 "--cluster-replicas", "1", "--cluster-yes"],
                capture_output=True, text=True, timeout=60, check=False)
            if out.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed:\n{out.stdout}"
                                   f"{out.stderr}")
            self.wait_ok(masters=len(self.nodes) // 2)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def node(self, port: int) -> Node:
        return next(n for n in self.nodes if n.port == port)

    def topology(self) -> list[NodeInfo]:
        """CLUSTER NODES, as one live node sees it."""
        for n in self.nodes:
            if not n.alive:
                continue
            try:
                with n.client() as c:
                    return _nodes(c)
            except redis.RedisError:
                continue
        raise RuntimeError("no cluster node answers")

    def master_for(self, key: str) -> Node:
        """The node that serves `key`'s slot now."""
        slot = key_slot(key.encode())
        info = next(i for i in self.topology()
                    if i.role == "master" and not i.failed and i.serves(slot))
        return self.node(info.port)

    def replica_of(self, master: Node) -> Node:
        topo = self.topology()
        mid = next(i.id for i in topo if i.port == master.port)
        return self.node(next(i.port for i in topo if i.master_id == mid))

    def roles(self, node: Node) -> set[str]:
        """`node`'s role as each live node sees it (one role once they agree)."""
        seen = set()
        for n in self.nodes:
            if n.alive:
                with n.client() as c:
                    seen |= {i.role for i in _nodes(c) if i.port == node.port}
        return seen

    def kill(self, node: Node) -> None:
        node.kill()

    def restart(self, node: Node) -> None:
        """The same port and nodes.conf: it rejoins (as a replica, if it was failed over)."""
        node.start()

    def wait_ok(self, timeout: float = 30.0, masters: int | None = None) -> None:
        """Poll until every live node says cluster_state:ok and, seen from each, every slot
        has a live master (and there are `masters` of them, if given), and every replica
        is in sync with its master (so that it can be promoted)."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            try:
                if self._whole(masters):
                    return
            except redis.RedisError as exc:
                last = repr(exc)
            time.sleep(0.05)
        raise RuntimeError(f"the cluster is not whole after {timeout} s {last}")

    def _whole(self, masters: int | None) -> bool:
        live = [n for n in self.nodes if n.alive]
        for n in live:
            with n.client() as c:
                if dict(c.execute_command("CLUSTER INFO")).get("cluster_state") != "ok":
                    return False
                topo = _nodes(c)
            serving = [i for i in topo if i.role == "master" and i.slots]
            if any(i.failed for i in serving) or sum(
                    hi - lo + 1 for i in serving for lo, hi in i.slots) != 16384:
                return False
            if masters is not None and (len(serving) != masters or sum(
                    i.role == "replica" for i in topo) != len(self.nodes) - masters):
                return False  # (a node not yet told it is a replica looks like a master)
            ports = {n.port for n in live}
            if any(i.port not in ports for i in serving):
                return False
            with n.client() as c:  # a replica that has not synced cannot take over
                info = c.info("replication")
            if info.get("role") == "slave" and info.get("master_link_status") != "up":
                return False
        return True


def _free_node_port() -> int:
    """A free port P whose cluster bus port P + 10000 is free too (and exists)."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 10000 > 65535:
            port -= 30000  # the ephemeral range starts at 32768: try below it
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def _nodes(c: redis.Redis) -> list[NodeInfo]:
    """CLUSTER NODES as `c`'s node sees it (redis-py parses it into a dict by address)."""
    out = []
    for addr, d in dict(c.execute_command("CLUSTER NODES")).items():  # type: ignore[no-untyped-call]
        flags = str(d["flags"]).split(",")
        slots = tuple((int(r[0]), int(r[-1])) for r in d["slots"])
        master = str(d["master_id"])
        out.append(NodeInfo(port=int(str(addr).split("@")[0].rsplit(":", 1)[1]),
                            id=str(d["node_id"]),
                            role="master" if "master" in flags else "replica",
                            master_id=None if master == "-" else master, slots=slots,
                            failed="fail" in flags or "fail?" in flags))
    return out


_KEY = pytest.StashKey[LocalCluster]()


@pytest.fixture(scope="session")
def redis_cluster(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """The session's Redis Cluster, whole (the same one wherever this fixture is imported)."""
    stash = request.config.stash
    cluster = stash.get(_KEY, None)
    if cluster is None:
        cluster = LocalCluster(tmp_path_factory.mktemp("cluster")).start()
        stash[_KEY] = cluster
        request.config.add_cleanup(cluster.stop)
    cluster.wait_ok()
    yield cluster
