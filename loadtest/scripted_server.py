"""A streaming server with known latencies, for checking what the load client measures.

Run as its own process (``python -m loadtest.scripted_server PORT LOG [--plain]``) so that
its timing never waits on the client's GIL or event loop. Blocking sockets, one thread per
connection, and every chunk written at an absolute deadline from when the request was
read (``time.sleep`` to the deadline, never a sum of sleeps, so never early):

* first content token (1 token) at TTFT_MS; then CHUNKS chunks of TOKENS_PER_CHUNK tokens
  every GAP_MS; the final usage and ``[DONE]`` right after the last chunk;
* running usage (``continuous_usage_stats``) on every content chunk;
* request ``x-loadtest-idx`` % 10 == 3: 429; == 7: 503 (probes, idx -1, always succeed;
  ``--plain``: none is rejected, for `loadtest.accuracy`);
* ``usage.prompt_tokens`` = words in the prompt + PROMPT_OVERHEAD;
* a request with the key ``sk-hold-after-N`` gets chunks until N tokens have gone out (N=0:
  none), then nothing more until the client leaves: a client that abandons a stream
  (patience, or after k tokens) then never races the script, however late it runs. Such a
  request is never rejected either: a 429 for a request that abandons at its patience
  would race that patience (whichever the client's loop saw first would decide the
  outcome).

A busy machine wakes threads late, here and in the client, so the script is only what was
asked for; what the server actually did is the ground truth. Each streamed request's times
go to the JSON-lines file named by argv[2], in ``time.perf_counter()`` seconds: on Linux
that is CLOCK_MONOTONIC, one clock for every process on the machine, so a client in another
process compares them with its own stamps. Each is taken *before* the bytes it dates are
written (``chunk_at``, ``done_at``) or *after* what it dates happened (``read_at``: the
request was read in full; ``left_at``: the client had closed the connection, seen by a read
that ended or a write that failed), so that the client's matching stamps must lie on the
far side of them, however late either side ran. The row is written before the connection
closes: a client that read the stream to its end finds its row in the log.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from typing import Any, TextIO

TTFT_MS = 80.0
GAP_MS = 30.0
CHUNKS = 4
TOKENS_PER_CHUNK = 3
PROMPT_OVERHEAD = 5
OUTPUT_TOKENS = 1 + CHUNKS * TOKENS_PER_CHUNK
HOLD_KEY = "sk-hold-after-"
HOLD_LIMIT_S = 60.0  # a held stream whose client never leaves is dropped after this


def status_for(idx: int, key: str = "", *, plain: bool = False) -> int:
    """The scripted status of request ``idx`` sent with bearer ``key``."""
    if plain or idx < 0 or key.startswith(HOLD_KEY):
        return 200
    if idx % 10 == 3:
        return 429
    if idx % 10 == 7:
        return 503
    return 200


def _read_request(conn: socket.socket) -> tuple[str, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        more = conn.recv(65536)
        if not more:
            raise ConnectionError("closed")
        data += more
    head, body = data.split(b"\r\n\r\n", 1)
    headers: dict[str, str] = {}
    first, *rest = head.split(b"\r\n")
    for line in rest:
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    want = int(headers.get("content-length", "0"))
    while len(body) < want:
        more = conn.recv(65536)
        if not more:
            raise ConnectionError("closed")
        body += more
    return first.decode().split(" ")[0], headers, body


def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _usage(prompt: int, done: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def bearer(headers: dict[str, str]) -> str:
    return headers.get("authorization", "").removeprefix("Bearer ")


def hold_after(headers: dict[str, str]) -> int | None:
    """N for a request with the key ``sk-hold-after-N``, else None."""
    key = bearer(headers)
    return int(key.removeprefix(HOLD_KEY)) if key.startswith(HOLD_KEY) else None


def wait_for_leave(conn: socket.socket) -> float:
    """Block until the client closes the connection; when it did (this side saw it)."""
    conn.settimeout(HOLD_LIMIT_S)  # (past it: socket.timeout, and no left_at)
    try:
        while conn.recv(4096):
            pass
    except ConnectionResetError:
        pass  # it left with a reset rather than a FIN
    return time.perf_counter()


def _reject(conn: socket.socket, status: int) -> None:
    err = json.dumps({"error": {"message": "scripted", "type": "overloaded",
                                "code": str(status), "param": None}}).encode()
    conn.sendall(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\nconnection: close\r\n\r\n" % (status, len(err)) + err)


def _stream(conn: socket.socket, headers: dict[str, str], body: dict[str, Any],
            row: dict[str, Any]) -> None:
    text = body["messages"][0]["content"] if "messages" in body else body["prompt"]
    prompt = len(text.split()) + PROMPT_OVERHEAD
    t0: float = row["read_at"]
    chunk_at: list[float] = row["chunk_at"]
    hold = hold_after(headers)
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                 b"x-sluice-queue-ms: 7\r\nconnection: close\r\n\r\n")
    sizes = [1] + [TOKENS_PER_CHUNK] * CHUNKS
    if body.get("max_tokens") == 1:
        sizes = [1]
    done = 0
    for k, n in enumerate(sizes):
        if hold is not None and done >= hold:
            row["left_at"] = wait_for_leave(conn)
            return
        due = t0 + (TTFT_MS + k * GAP_MS) / 1000
        time.sleep(max(0.0, due - time.perf_counter()))
        done += n
        chunk = {"choices": [{"index": 0, "delta": {"content": " tok" * n}}],
                 "usage": _usage(prompt, done)}
        chunk_at.append(time.perf_counter())
        conn.sendall(_event(chunk))
    row["done_at"] = time.perf_counter()
    conn.sendall(_event({"choices": [], "usage": _usage(prompt, done)}) + b"data: [DONE]\n\n")


def serve(conn: socket.socket, log: TextIO, lock: threading.Lock, plain: bool) -> None:
    row: dict[str, Any] | None = None
    try:
        method, headers, raw = _read_request(conn)
        t0 = time.perf_counter()
        if method != "POST":  # no /metrics here: the client's scraper must cope
            conn.sendall(b"HTTP/1.1 404 X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            return
        idx = int(headers.get("x-loadtest-idx", "-1"))
        status = status_for(idx, bearer(headers), plain=plain)
        if status != 200:
            _reject(conn, status)
            return
        row = {"idx": idx, "read_at": t0, "chunk_at": [], "done_at": None, "left_at": None}
        _stream(conn, headers, json.loads(raw), row)
    except TimeoutError:
        pass  # a held stream whose client never left: no left_at
    except OSError:
        # A write found the connection closed: the client had gone (one that gave up before
        # this side even answered it, say). Its row says how far the script got.
        if row is not None and row["left_at"] is None:
            row["left_at"] = time.perf_counter()
    finally:
        if row is not None:
            with lock:
                log.write(json.dumps(row) + "\n")
                log.flush()
        conn.close()


def main(port: int, log_path: str, plain: bool = False) -> None:
    log = open(log_path, "a")  # noqa: SIM115 - open for the life of the process
    lock = threading.Lock()
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(1024)
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=serve, args=(conn, log, lock, plain), daemon=True).start()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], plain="--plain" in sys.argv[3:])
