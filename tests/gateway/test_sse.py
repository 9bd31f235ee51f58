"""The SSE rewriter: its byte-level fast path gives exactly what the json path gives."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.sse import ChunkRewriter
from protocol.sse import EventSplitter


class JsonOnly(ChunkRewriter):
    def _learn(self, data: bytes, obj: dict[str, Any]) -> None:
        return  # never takes the fast path: the reference


texts = st.text(max_size=12)  # any characters: quotes, braces, "usage", non-ASCII
usage_obj = st.builds(
    lambda p, c, cached: {"prompt_tokens": p, "completion_tokens": c,
                          "total_tokens": p + c,
                          **({"prompt_tokens_details": {"cached_tokens": cached}}
                             if cached is not None else {})},
    st.integers(0, 10**6), st.integers(0, 10**6), st.none() | st.integers(0, 99))


@st.composite
def streams(draw: Any) -> tuple[list[bytes], bool, bool]:
    model = draw(st.sampled_from(["up-model", "ü-model", 'we"ird']))
    fp = draw(st.sampled_from(["fp_up", "fp_ü"]))
    running = draw(st.booleans())
    events = []
    n = draw(st.integers(1, 6))
    for i in range(n):
        chunk = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": model,
                 "system_fingerprint": fp,
                 "choices": [{"index": 0, "delta": {"content": draw(texts)},
                              "finish_reason": "stop" if i == n - 1 else None}],
                 "usage": draw(usage_obj) if running else None}
        events.append(chunk)
    events.append({"id": "x", "object": "chat.completion.chunk", "created": 1,
                   "model": model, "system_fingerprint": fp, "choices": [],
                   "usage": draw(usage_obj)})
    compact = draw(st.booleans())
    ascii_only = draw(st.booleans())
    raw = [json.dumps(e, separators=(",", ":") if compact else (", ", ": "),
                      ensure_ascii=ascii_only).encode() for e in events]
    return [b"data: " + r for r in raw] + [b"data: [DONE]"], draw(st.booleans()), \
        draw(st.booleans())


def run(rewriter: ChunkRewriter, events: list[bytes]) -> list[Any]:
    out = []
    for e in events:
        r = rewriter.rewrite(e)
        if r is not None:
            assert r.endswith(b"\n\n") and r.startswith(b"data: ")
            body = r[6:-2]
            out.append(body.decode() if body == b"[DONE]" else json.loads(body))
    return out


@settings(max_examples=300, deadline=None)
@given(streams())
def test_fast_path_equals_json_path(stream: tuple[list[bytes], bool, bool]) -> None:
    events, client_usage, client_continuous = stream
    fast = ChunkRewriter("public", "fp_gateway", client_usage, client_continuous)
    slow = JsonOnly("public", "fp_gateway", client_usage, client_continuous)
    assert run(fast, events) == run(slow, events)
    assert fast.usage == slow.usage and fast.chunks == slow.chunks and fast.done
    assert fast.tokens == slow.tokens and fast.finish_reason == slow.finish_reason
    assert fast._fast is not None  # the fast path was learned and used


def test_the_fast_path_is_taken() -> None:
    events = [(b'data: {"model":"m","system_fingerprint":"fp","choices":[{"delta":'
              b'{"content":"a"}}],"usage":null}')] * 3
    r = ChunkRewriter("pub", "fp_g", False, False)
    outs = [r.rewrite(e) for e in events]
    assert r._fast is not None
    assert outs[-1] == b'data: {"model":"pub","system_fingerprint":"fp_g","choices":' \
                       b'[{"delta":{"content":"a"}}]}\n\n'


def test_error_events_pass_and_are_noted() -> None:
    r = ChunkRewriter("pub", "fp_g", False, False)
    out = r.rewrite(b'data: {"error": {"message": "x"}}')
    assert out == b'data: {"error": {"message": "x"}}\n\n' and r.error


def test_events_as_the_splitter_hands_them_out() -> None:
    """Any line ends, comments and multi-line data: the client gets one-line LF events."""
    chunk = {"model": "m", "system_fingerprint": "fp", "usage": None,
             "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]}
    one_line = json.dumps(chunk).encode()
    at = one_line.index(b",") + 1  # a line end between two members: still one JSON text
    multi = b"data: " + one_line[:at] + b"\r\ndata: " + one_line[at:]
    stream = (b": keep-alive\r\n\r\n" + b"data: " + one_line + b"\r\n\r\n" + multi
              + b"\r\n\r\n" + b": note\rdata: [DONE]\r\r")
    r = ChunkRewriter("pub", "fp_g", False, False)
    splitter = EventSplitter()
    out: list[bytes | None] = []
    for at in range(0, len(stream), 7):  # fed in small pieces
        out += [r.rewrite(e) for e in splitter.feed(stream[at:at + 7])]
    assert out[0] == b": keep-alive\n\n"
    expected = {**chunk, "model": "pub", "system_fingerprint": "fp_g"}
    del expected["usage"]
    assert [json.loads(o[6:]) for o in out[1:3]] == [expected, expected]  # type: ignore[index]
    assert out[3] == b"data: [DONE]\n\n" and r.done and r.chunks == 2 and r.tokens == 2


CHUNK = (b'data: {"model":"m","system_fingerprint":"fp","choices":[{"delta":{"content":"a"}}],'
         b'"usage":null}')


@pytest.mark.parametrize(("event", "out"), [
    (b"retry: 3000", None),  # the SDKs would read these as events with empty data
    (b"id: 7", None),
    (b"event: ping", None),
    (b"id: 1\nretry: 10\n: ping - 2025-01-01", b": ping - 2025-01-01\n\n"),
    (b": a\nid: 2\n:b", b": a\n:b\n\n"),
    (b": keep-alive", b": keep-alive\n\n"),
])
def test_only_comments_of_events_without_data_reach_the_client(event: bytes,
                                                               out: bytes | None) -> None:
    assert ChunkRewriter("pub", "fp_g", False, False).rewrite(event) == out


@pytest.mark.parametrize("event", [
    b"event: ping\ndata: 2025-01-01 00:00:00",  # another type: not a chunk (and not JSON)
    b"event: ping\ndata: {}",
    b"data", b"data:", b"data: ", b"data:\ndata:",  # empty data
])
def test_typed_events_and_empty_data_are_dropped(event: bytes) -> None:
    r = ChunkRewriter("pub", "fp_g", False, False)
    assert r.rewrite(event) is None and r.chunks == 0 and not r.error


def test_message_and_error_events_with_fields_are_read_for_their_data() -> None:
    r = ChunkRewriter("pub", "fp_g", False, False)
    typed = b"id: 1\nevent: message\n" + CHUNK + b"\nretry: 10"
    assert r.rewrite(typed) == b'data: {"model":"pub","system_fingerprint":"fp_g",' \
                               b'"choices":[{"delta":{"content":"a"}}]}\n\n'
    assert r.rewrite(b"event: error\ndata:{\"error\": {\"message\": \"x\"}}") \
        == b'data: {"error": {"message": "x"}}\n\n' and r.error
    assert r.rewrite(b"event\ndata: [DONE]") == b"data: [DONE]\n\n" and r.done
