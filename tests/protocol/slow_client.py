"""Raw-socket clients that send too slowly, for the slow-sender tests of both servers.

Nothing here times the server: each helper polls with a generous deadline and reports what
came back (or that nothing did), so the tests assert outcomes, never durations.
"""

from __future__ import annotations

import json
import os
import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GIVE_UP_S = 20.0  # far past any limit the tests configure: only a server that never cuts
# the connection (today's uvicorn) gets here


@dataclass(slots=True)
class Answer:
    """What the server sent before it closed the connection."""

    raw: bytes

    @property
    def status(self) -> int | None:
        if not self.raw.startswith(b"HTTP/1.1 "):
            return None
        return int(self.raw.split(b" ", 2)[1])

    @property
    def headers(self) -> dict[str, str]:
        head = self.raw.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")[1:]
        return {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in head)}

    def json(self) -> Any:
        body = self.raw.split(b"\r\n\r\n", 1)[1]
        if self.headers.get("transfer-encoding") == "chunked":
            out = b""
            while True:
                size, rest = body.split(b"\r\n", 1)
                if int(size, 16) == 0:
                    break
                out += rest[:int(size, 16)]
                body = rest[int(size, 16) + 2:]
            body = out
        return json.loads(body)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _drain(sock: socket.socket, deadline: float) -> bytes:
    """Everything the server sends until it closes (or until ``deadline``)."""
    out = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        try:
            data = sock.recv(65536)
        except ConnectionResetError:  # closed with our bytes unread: still closed
            return out
        if not data:
            return out
        out += data
    raise AssertionError(f"the server kept the connection open for {GIVE_UP_S:g} s "
                         f"(answered {out[:80]!r})")


def trickle(sock: socket.socket, data: bytes, gap_s: float = 0.05,
            give_up_s: float = GIVE_UP_S, through_answer: bool = False) -> Answer:
    """Send ``data`` one byte every ``gap_s`` (then nothing) until the server answers or
    closes; its answer. With ``through_answer``, go on sending after an answer, until the
    server closes. Fails if the connection is still open after ``give_up_s``."""
    deadline = time.monotonic() + give_up_s
    got = b""
    sent = 0
    while time.monotonic() < deadline:
        ready, _, _ = select.select([sock], [], [], gap_s)
        if ready and not through_answer:
            return Answer(_drain(sock, deadline))
        if ready:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                return Answer(got)
            if not chunk:
                return Answer(got)
            got += chunk
        elif sent < len(data):
            try:
                sock.sendall(data[sent:sent + 1])
            except (BrokenPipeError, ConnectionResetError):
                return Answer(got + _drain(sock, deadline))
            sent += 1
    raise AssertionError(f"the server kept the connection open for {give_up_s:g} s "
                         f"(answered {got[:80]!r})")


def request(port: int, head: bytes, body: bytes = b"") -> Answer:
    """One request sent at once on a fresh connection (``connection: close``)."""
    with connect(port) as sock:
        sock.sendall(head + body)
        return Answer(_drain(sock, time.monotonic() + GIVE_UP_S))


def post_head(path: str, length: int, *extra: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: 127.0.0.1", "content-type: application/json",
             f"content-length: {length}", "connection: close", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server has closed ``sock`` (whatever it sent first); never blocks."""
    try:
        ready, _, _ = select.select([sock], [], [], 0)
        if not ready:
            return False
        while True:
            data = sock.recv(65536, socket.MSG_DONTWAIT)
            if not data:
                return True
    except BlockingIOError:
        return False
    except (ConnectionResetError, TimeoutError):
        return True


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = GIVE_UP_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(0.02)


def open_fds(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def cuts(metrics: str, prefix: str) -> dict[str, float]:
    """``<prefix>connections_cut_total`` by reason, from a /metrics text."""
    name = prefix + "connections_cut_total{reason=\""
    out = {}
    for line in metrics.splitlines():
        if line.startswith(name):
            reason, value = line[len(name):].split("\"}", 1)
            out[reason] = float(value)
    return out
