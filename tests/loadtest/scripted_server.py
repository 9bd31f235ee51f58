"""A streaming server with known latencies, for checking what the load client measures.

Run as its own process (``python -m tests.loadtest.scripted_server PORT LOG``) so that its
timing never waits on the test's GIL or event loop. Blocking sockets, one thread per
connection, and every chunk written at an absolute deadline from when the request was
read (``time.sleep`` to the deadline, never a sum of sleeps), so the script holds to well
under a millisecond:

* first content token (1 token) at TTFT_MS; then CHUNKS chunks of TOKENS_PER_CHUNK tokens
  every GAP_MS; the final usage and ``[DONE]`` right after the last chunk;
* running usage (``continuous_usage_stats``) on every content chunk;
* request ``x-loadtest-idx`` % 10 == 3: 429; == 7: 503 (probes, idx -1, always succeed);
* ``usage.prompt_tokens`` = words in the prompt + PROMPT_OVERHEAD.

A busy machine can still wake a thread late; so each request's actual write times (ms from
reading the request) go to the JSON-lines file named by argv[2], as the ground truth.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from typing import TextIO

TTFT_MS = 80.0
GAP_MS = 30.0
CHUNKS = 4
TOKENS_PER_CHUNK = 3
PROMPT_OVERHEAD = 5
OUTPUT_TOKENS = 1 + CHUNKS * TOKENS_PER_CHUNK


def status_for(idx: int) -> int:
    if idx >= 0 and idx % 10 == 3:
        return 429
    if idx >= 0 and idx % 10 == 7:
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
    headers = {}
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


def serve(conn: socket.socket, log: TextIO, lock: threading.Lock) -> None:
    try:
        method, headers, raw = _read_request(conn)
        t0 = time.perf_counter()
        if method != "POST":  # no /metrics here: the client's scraper must cope
            conn.sendall(b"HTTP/1.1 404 X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            return
        body = json.loads(raw)
        status = status_for(int(headers.get("x-loadtest-idx", "-1")))
        if status != 200:
            err = json.dumps({"error": {"message": "scripted", "type": "overloaded",
                                        "code": str(status), "param": None}}).encode()
            conn.sendall(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\nconnection: close\r\n\r\n" % (status, len(err))
                         + err)
            return
        text = body["messages"][0]["content"] if "messages" in body else body["prompt"]
        prompt = len(text.split()) + PROMPT_OVERHEAD
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"x-sluice-queue-ms: 7\r\nconnection: close\r\n\r\n")
        sizes = [1] + [TOKENS_PER_CHUNK] * CHUNKS
        if body.get("max_tokens") == 1:
            sizes = [1]
        done, written = 0, []
        for k, n in enumerate(sizes):
            due = t0 + (TTFT_MS + k * GAP_MS) / 1000
            time.sleep(max(0.0, due - time.perf_counter()))
            done += n
            chunk = {"choices": [{"index": 0, "delta": {"content": " tok" * n}}],
                     "usage": _usage(prompt, done)}
            written.append((time.perf_counter() - t0) * 1000)
            conn.sendall(_event(chunk))
        conn.sendall(_event({"choices": [], "usage": _usage(prompt, done)})
                     + b"data: [DONE]\n\n")
        end = (time.perf_counter() - t0) * 1000
        with lock:
            log.write(json.dumps({"idx": int(headers.get("x-loadtest-idx", "-1")),
                                  "chunks": written, "done": end}) + "\n")
            log.flush()
    except OSError:
        pass  # the client went away (a cancellation): nothing to clean up
    finally:
        conn.close()


def main(port: int, log_path: str) -> None:
    log = open(log_path, "a")  # noqa: SIM115 - open for the life of the process
    lock = threading.Lock()
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(256)
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=serve, args=(conn, log, lock), daemon=True).start()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
