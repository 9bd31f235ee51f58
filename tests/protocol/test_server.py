"""protocol.server: slow senders are cut off and open connections capped, on a real uvicorn.

Each test runs the guarded protocol on 127.0.0.1 in a thread, in front of a small ASGI app,
and talks to it over raw sockets. Limits are small (a fraction of a second); the tests poll
with generous deadlines and assert outcomes, not durations.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import uvicorn

from protocol.limits import MAX_HEAD_BYTES, MAX_TRAILER_BYTES, ConnectionCounts, ConnectionLimits
from protocol.server import TESTED_UVICORN, http_protocol
from tests.backend.server.conftest import REPO_ROOT, free_port

from .slow_client import (
    Answer,
    closed_by_server,
    connect,
    open_fds,
    post_head,
    request,
    trickle,
    wait_until,
)

FAST = ConnectionLimits(request_read_s=0.3, body_min_bytes_per_s=1000, max_connections=64)


class App:
    """Echoes the body; ``/hold`` waits for ``release``; ``/early`` answers without reading;
    ``/lazy`` waits ``lazy_s`` before reading. Records what it saw."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.disconnects = 0
        self.headers_at_disconnect: list[int] = []  # how many the scope held by then
        self.release: asyncio.Event | None = None
        self.lazy_s = 0.0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.calls.append(scope["path"])
        if scope["path"] == "/hold":
            assert self.release is not None
            await self.release.wait()
        if scope["path"] == "/lazy":
            await asyncio.sleep(self.lazy_s)
        body = b""
        while scope["path"] != "/early":
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnects += 1
                self.headers_at_disconnect.append(len(scope["headers"]))
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class Served:
    def __init__(self, limits: ConnectionLimits) -> None:
        self.app = App()
        self.port = free_port()
        self.counts = ConnectionCounts()
        self.server = uvicorn.Server(uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="critical",
            lifespan="off", http=http_protocol(limits, self.counts)))
        self.loop: asyncio.AbstractEventLoop | None = None

    def run(self) -> None:
        import uvloop  # the loop both servers run on

        self.loop = uvloop.new_event_loop()
        self.app.release = asyncio.Event()
        self.loop.run_until_complete(self.server.serve())

    def release(self) -> None:
        assert self.loop is not None and self.app.release is not None
        self.loop.call_soon_threadsafe(self.app.release.set)

    def idle(self) -> bool:
        state = self.server.server_state
        return not state.connections and not state.tasks

    def cuts(self) -> dict[str, int]:
        """The cuts and refusals counted so far (those not yet at 0)."""
        return {reason: n for reason, n in self.counts.snapshot() if n}


@contextmanager
def serving(limits: ConnectionLimits = FAST) -> Iterator[Served]:
    served = Served(limits)
    thread = threading.Thread(target=served.run, daemon=True)
    thread.start()
    wait_until(lambda: served.server.started, "the server started")
    try:
        yield served
    finally:
        served.release()
        served.server.should_exit = True
        thread.join(timeout=10)


def echo(port: int, body: bytes = b'{"a": 1}') -> Answer:
    return request(port, post_head("/echo", len(body)), body)


def test_a_head_sent_a_byte_at_a_time_gets_408_and_never_reaches_the_app() -> None:
    with serving() as s:
        fds = open_fds()
        with connect(s.port) as sock:
            answer = trickle(sock, post_head("/echo", 2) + b"{}")
        assert answer.status == 408
        assert answer.headers["connection"] == "close"
        err = answer.json()["error"]
        assert err["code"] == "request_timeout" and err["type"] == "invalid_request_error"
        assert s.app.calls == []
        assert s.cuts() == {"head_timeout": 1}
        ok = echo(s.port)  # a normal request is served as before
        assert ok.status == 200 and ok.raw.endswith(b'{"a": 1}')
        wait_until(s.idle, "no connection or task left on the server")
        wait_until(lambda: open_fds() <= fds, "no file descriptor left open")


def test_a_connection_that_never_sends_is_closed_without_an_answer() -> None:
    with serving() as s, connect(s.port) as sock:
        assert trickle(sock, b"").raw == b""
        wait_until(s.idle, "the connection is gone")
        assert s.cuts() == {"idle": 1}


def test_a_head_trickled_on_a_kept_alive_connection_is_cut_too() -> None:
    """The second request's head counts from its first byte (uvicorn's keep-alive timer,
    which any byte cancels, no longer covers it)."""
    with serving() as s, connect(s.port) as sock:
        sock.sendall(b"GET /echo HTTP/1.1\r\nhost: x\r\n\r\n")
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 ")
        answer = trickle(sock, b"GET /echo HTTP/1.1\r\nhost: x\r\nx-slow: yes\r\n")
        assert answer.status == 408
        assert s.app.calls == ["/echo"]


def test_blank_lines_trickled_between_requests_do_not_hold_the_connection() -> None:
    """Cut as a trickled head would be, but without an answer: blank lines are no request
    (the parser skips them), and a 408 could cross the client's next request on the wire."""
    with serving() as s, connect(s.port) as sock:
        sock.sendall(b"GET /echo HTTP/1.1\r\nhost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        assert trickle(sock, b"\r\n" * 1000).raw == b""
        wait_until(s.idle, "the connection is gone")
        assert s.cuts() == {"idle": 1}


def test_a_stray_crlf_then_silence_is_closed_without_an_unsolicited_408() -> None:
    """Some clients send CRLF after a body. Arriving while the answer is pending, it starts
    the next head's clock; when that runs out on an idle connection, the server closes it
    as uvicorn's keep-alive expiry does, answering nothing nobody asked."""
    with serving() as s, connect(s.port) as sock:
        sock.sendall(b"POST /hold HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
        wait_until(lambda: "/hold" in s.app.calls, "the request held")
        sock.sendall(b"\r\n")
        time.sleep(0.5)  # > request_read_s with the stray CRLF read: the clock has run
        s.release()
        raw = trickle(sock, b"", through_answer=True).raw  # then silence, until closed
        assert raw.count(b"HTTP/1.1 ") == 1 and raw.startswith(b"HTTP/1.1 200 "), raw
        assert raw.endswith(b"\r\n\r\n{}")
        assert s.cuts() == {"idle": 1}


def test_a_stray_crlf_does_not_cut_a_long_answer_but_a_trickled_head_after_it_is() -> None:
    """Some clients send CRLF after a body; it must not start a head clock that cuts the
    answer still going out (the bytes after it wait for the connection to be free)."""
    with serving() as s, connect(s.port) as sock:
        sock.sendall(b"POST /hold HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}\r\n")
        wait_until(lambda: "/hold" in s.app.calls, "the request held")
        time.sleep(1.0)  # > 3 × request_read_s with the stray CRLF read
        assert not closed_by_server(sock)
        s.release()
        answer = trickle(sock, b"GET /echo HTTP/1.1\r\nhost: x\r\n", through_answer=True)
        first, second = answer.raw.split(b"HTTP/1.1 ")[1:]
        assert first.startswith(b"200 ") and first.endswith(b"\r\n\r\n{}")
        assert second.startswith(b"408 ")


def test_a_slow_body_gets_408_and_the_app_sees_the_client_leave() -> None:
    body = b'{"x": "' + b"y" * 500 + b'"}'
    with serving() as s:
        with connect(s.port) as sock:
            sock.sendall(post_head("/echo", len(body)))
            answer = trickle(sock, body)
        assert answer.status == 408
        assert answer.json()["error"]["code"] == "request_timeout"
        wait_until(lambda: s.app.disconnects == 1, "the app saw http.disconnect")
        assert s.cuts() == {"body_timeout": 1}
        assert echo(s.port, body).status == 200  # the same body, sent at once
        wait_until(s.idle, "no connection or task left on the server")


def test_a_body_still_trickling_after_the_answer_is_cut() -> None:
    """The app answered without reading the body (as the gateway does with a bad key):
    the connection would otherwise stay open as long as bytes keep coming."""
    with serving() as s, connect(s.port) as sock:
        sock.sendall(post_head("/early", 100_000).replace(b"connection: close\r\n", b""))
        answer = trickle(sock, b"x" * 1000, through_answer=True)
        assert answer.status == 200  # its answer, then the cut
        wait_until(s.idle, "the connection is gone")


def test_only_the_clients_slowness_counts_against_the_body() -> None:
    """A body the server holds back (flow control while the app is busy, an Expect:
    100-continue not yet answered) is not cut; a slow one on the same server is."""
    with serving() as s:
        s.app.lazy_s = 1.0  # > request_read_s: the app reads late
        big = b"z" * 300_000  # over uvicorn's 64 KiB high-water mark: reading pauses
        assert request(s.port, post_head("/lazy", len(big)), big).status == 200
        with connect(s.port) as sock:
            sock.sendall(post_head("/lazy", 2, "expect: 100-continue"))
            assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
            sock.sendall(b"{}")
            assert trickle(sock, b"").status == 200
        with connect(s.port) as sock:
            sock.sendall(post_head("/echo", 600))
            assert trickle(sock, b"x" * 600).status == 408


@pytest.mark.parametrize("ended", [True, False], ids=["whole", "unended"])
def test_a_head_over_the_size_limit_gets_431(ended: bool) -> None:
    """Whole (one read: refused before the app) or still growing (refused as it grows;
    uvicorn's parser would buffer any size)."""
    with serving() as s:
        head = b"GET /echo HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * MAX_HEAD_BYTES
        if ended:
            head += b"\r\n\r\n"
        else:
            head += b"a" * 1024  # all read by the server: its close is no reset
        with connect(s.port) as sock:
            try:
                sock.sendall(head)
            except (BrokenPipeError, ConnectionResetError):
                pass
            answer = trickle(sock, b"")
        assert answer.status == 431
        assert answer.json()["error"]["code"] == "request_header_too_large"
        assert s.app.calls == []
        assert s.cuts() == {"head_too_large": 1}


CHUNKED = b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"


def test_trailers_past_the_limit_get_431_and_are_not_kept() -> None:
    """After a chunked body's last chunk come trailer lines, as many as the client likes:
    uvicorn's parser hands each to on_header, which kept them all (one connection pushed
    131 MB in 8 s). What follows the last payload byte is bounded like a head."""
    with serving() as s, connect(s.port) as sock:
        sock.sendall(CHUNKED + b"1\r\na\r\n0\r\n")
        wait_until(lambda: "/echo" in s.app.calls, "the app reads the body")
        line = b"x-trailer: " + b"t" * 80 + b"\r\n"
        sent = 0
        try:  # just over the limit: all of it read by the server, its close is no reset
            while sent <= MAX_TRAILER_BYTES + 4096:
                sock.sendall(line * 64)
                sent += len(line) * 64
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = trickle(sock, b"")
        assert answer.status == 431
        assert answer.headers["connection"] == "close"
        err = answer.json()["error"]
        assert err["code"] == "request_header_too_large"
        assert "trailer" in err["message"]
        wait_until(lambda: s.app.disconnects == 1, "the app saw the client leave")
        kept = s.app.headers_at_disconnect[0] - 2  # host, transfer-encoding
        assert kept * len(line) <= MAX_TRAILER_BYTES + 512 * 1024  # a read's worth at most
        assert s.cuts() == {"trailers_too_large": 1}
        wait_until(s.idle, "no connection or task left on the server")


def test_a_body_in_tiny_chunks_with_a_few_trailers_is_served() -> None:
    """Chunk framing is not payload either, but it comes with payload: only what follows
    the last payload byte is bounded, so 1-byte chunks (5 bytes of framing each) pass."""
    payload = bytes(range(97, 123)) * 2000  # 52 KB, in 52,000 chunks
    framed = b"".join(b"1\r\n" + payload[i:i + 1] + b"\r\n" for i in range(len(payload)))
    with serving() as s:
        answer = request(s.port, CHUNKED.replace(b"host: x", b"host: x\r\nconnection: close"),
                         framed + b"0\r\nx-checksum: 1\r\nx-more: 2\r\n\r\n")
        assert answer.status == 200
        assert answer.raw.endswith(b"\r\n\r\n" + payload)


def test_bytes_that_are_not_http_get_400_in_openai_shape() -> None:
    """uvicorn answers its parser's errors in text/plain; every answer here is JSON."""
    with serving() as s:
        answer = request(s.port, b"GET /echo HTTP/1.1\r\nhost: x\r\nbad header\r\n\r\n")
        assert answer.status == 400
        assert answer.headers["content-type"] == "application/json"
        assert answer.headers["connection"] == "close"
        err = answer.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_http_request"
        assert s.app.calls == []
        assert s.cuts() == {"bad_request": 1}


def test_a_malformed_chunk_under_a_running_app_gets_400_and_the_app_sees_it_leave() -> None:
    with serving() as s, connect(s.port) as sock:
        sock.sendall(CHUNKED + b"2\r\n{}\r\n")
        wait_until(lambda: "/echo" in s.app.calls, "the app reads the body")
        sock.sendall(b"zz\r\n")  # not a chunk size
        answer = trickle(sock, b"")
        assert answer.status == 400
        assert answer.json()["error"]["code"] == "invalid_http_request"
        wait_until(lambda: s.app.disconnects == 1, "the app saw the client leave")


def test_connections_past_the_cap_get_503_with_retry_after_until_slots_free() -> None:
    with serving(ConnectionLimits(request_read_s=5, max_connections=3)) as s:
        held = [connect(s.port) for _ in range(3)]
        for sock in held:  # three requests in flight: the app holds them
            sock.sendall(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
        wait_until(lambda: s.app.calls.count("/hold") == 3, "three requests held")
        refused = echo(s.port)
        assert refused.status == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["retry-after-ms"] == "1000"
        err = refused.json()["error"]
        assert err["code"] == "too_many_connections" and err["type"] == "server_error"
        assert "/echo" not in s.app.calls  # refused before the app
        assert s.cuts() == {"too_many_connections": 1}
        s.release()
        for sock in held:
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
            sock.close()
        wait_until(lambda: echo(s.port).status == 200, "served again once slots freed")
        wait_until(s.idle, "no connection or task left on the server")


def test_slow_connections_over_the_cap_are_cut_and_the_server_serves_again() -> None:
    with serving(ConnectionLimits(request_read_s=2, max_connections=4)) as s:
        fds = open_fds()
        slow = [connect(s.port) for _ in range(4)]
        for sock in slow:
            sock.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\n")  # and never the rest
        refused = echo(s.port)
        assert not any(closed_by_server(sock) for sock in slow), "cut before the check"
        assert refused.status == 503
        wait_until(lambda: all(closed_by_server(sock) for sock in slow), "the slow ones cut")
        for sock in slow:
            sock.close()
        assert echo(s.port).status == 200
        assert s.app.calls == ["/echo"]
        wait_until(s.idle, "no connection or task left on the server")
        wait_until(lambda: open_fds() <= fds, "no file descriptor left open")


def test_pipelined_requests_are_answered_in_order_then_a_trickled_one_is_cut() -> None:
    with serving() as s, connect(s.port) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\n\r\na"
                     b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\n\r\nb")
        raw = trickle(sock, b"POST /echo HTTP/1.1\r\nhost: x\r\n", through_answer=True).raw
        first, second, third = raw.split(b"HTTP/1.1 ")[1:]
        assert first.startswith(b"200 ") and first.endswith(b"\r\n\r\na")
        assert second.startswith(b"200 ") and second.endswith(b"\r\n\r\nb")
        assert third.startswith(b"408 ")


def test_limits_are_validated() -> None:
    for bad in ({"request_read_s": 0}, {"request_read_s": float("inf")},
                {"body_min_bytes_per_s": 0}, {"max_connections": 0}):
        with pytest.raises(ValueError):
            ConnectionLimits(**bad)


@pytest.mark.parametrize("lacking", ["a method", "a field of the protocol",
                                     "a field of the request cycle"])
def test_a_uvicorn_without_what_the_protocol_uses_fails_at_server_start(
        lacking: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The subclass leans on uvicorn internals: a uvicorn lacking one makes http_protocol()
    (called as a server starts) fail, naming it, instead of a loop callback failing on
    every connection while slow senders go uncut."""
    from uvicorn.protocols.http import httptools_impl

    http_protocol(FAST)  # the installed uvicorn has it all
    if lacking == "a method":
        monkeypatch.delattr(httptools_impl.HttpToolsProtocol, "send_400_response")
        missing = "HttpToolsProtocol.send_400_response()"
    else:
        cls, field = ((httptools_impl.HttpToolsProtocol, "pipeline")
                      if lacking == "a field of the protocol"
                      else (httptools_impl.RequestResponseCycle, "waiting_for_100_continue"))
        init = cls.__init__

        def without(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            delattr(self, field)

        monkeypatch.setattr(cls, "__init__", without)
        missing = f"{cls.__name__}.{field}"
    with pytest.raises(RuntimeError, match=f"uvicorn {uvicorn.__version__}") as raised:
        http_protocol(FAST)
    assert missing in str(raised.value)


def test_pyproject_allows_only_the_uvicorn_versions_tested() -> None:
    import tomllib

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    spec = next(Requirement(d) for d in project["dependencies"]
                if Requirement(d).name == "uvicorn").specifier
    assert spec == SpecifierSet(TESTED_UVICORN)
    assert any(s.operator == "<" for s in spec), "an upper bound: the internals may change"
    assert uvicorn.__version__ in spec
