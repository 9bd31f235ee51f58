"""SSE framing: the splitter against the spec's line ends, chunk boundaries and fields."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import ServiceUnavailable
from protocol.sse import DONE, EventSplitter, EventTooLong, dumps, error_event, event, event_data


def split_all(stream: bytes, cuts: list[int] | None = None) -> tuple[list[bytes], int]:
    """Every event of ``stream`` fed in pieces cut at ``cuts``; and what stays pending."""
    s = EventSplitter()
    points = [0, *sorted(cuts or []), len(stream)]
    out: list[bytes] = []
    for a, b in itertools.pairwise(points):
        out += s.feed(stream[a:b])
    return out, s.pending


def test_encoding() -> None:
    assert dumps({"a": "ü", "b": [1, None]}) == '{"a":"ü","b":[1,null]}'
    assert event({"x": 1}) == b'data: {"x":1}\n\n'
    assert DONE == b"data: [DONE]\n\n"


def test_error_event_carries_the_status_and_ends_the_stream() -> None:
    raw = error_event(ServiceUnavailable("going away", code="aborted"))
    assert raw.endswith(b"\n\n" + DONE)
    (first, done), _ = split_all(raw)
    assert done == b"data: [DONE]"
    data = event_data(first)
    assert data is not None
    assert json.loads(data) == {"error": {"message": "going away", "type": "server_error",
                                          "code": "aborted", "param": None, "status": 503}}


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_line_ends(eol: bytes) -> None:
    stream = (b"data: {\"a\":1}" + eol + eol + b": keep-alive" + eol + eol
              + b"data: [DONE]" + eol + eol)
    events, pending = split_all(stream)
    assert events == [b'data: {"a":1}', b": keep-alive", b"data: [DONE]"]
    assert pending == 0


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_every_split_point_gives_the_same_events(eol: bytes) -> None:
    stream = eol.join([b"data: one", b"", b"data: two", b"data: more", b"", b""]) + b"x"
    whole, _ = split_all(stream)
    assert whole == [b"data: one", b"data: two\ndata: more"]
    for cut in range(len(stream) + 1):
        assert split_all(stream, [cut]) == (whole, 1), cut
    for a in range(len(stream) + 1):
        for b in range(a, len(stream) + 1):
            assert split_all(stream, [a, b])[0] == whole


def test_crlf_split_between_cr_and_lf_is_one_line_end() -> None:
    s = EventSplitter()
    assert s.feed(b"data: a\r") == []
    assert s.feed(b"\n\r") == [b"data: a"]  # CR LF, then CR: a blank line
    assert s.feed(b"\ndata: b\r") == []  # that LF pairs with the CR before it
    assert s.feed(b"\n\r\n") == [b"data: b"]


def test_blank_lines_in_a_row_and_at_the_start_make_no_events() -> None:
    stream = b"\n\n\ndata: a\n\n\n\n\ndata: b\n\n\n"
    for cut in range(len(stream) + 1):
        assert split_all(stream, [cut])[0] == [b"data: a", b"data: b"], cut


def test_an_unended_event_is_pending_and_bounded() -> None:
    s = EventSplitter(max_event_bytes=10)
    assert s.feed(b"data: 1234") == []
    assert s.pending == 10
    with pytest.raises(EventTooLong):
        s.feed(b"5")


def test_empty_chunks_keep_a_pending_cr() -> None:
    s = EventSplitter()
    assert s.feed(b"data: a\r\n\r") == [b"data: a"]
    assert s.feed(b"") == []
    assert s.feed(b"\ndata: b\r\n") == []  # the LF after the CR is not a blank line
    assert s.pending == len(b"data: b\n")


@pytest.mark.parametrize(("raw", "data"), [
    (b"data: {}", b"{}"),
    (b"data:{}", b"{}"),
    (b"data:  x", b" x"),  # only one space is the separator
    (b"data: a\ndata: b", b"a\nb"),
    (b": comment\ndata: x\nid: 7", b"x"),
    (b"event: ping\ndata", b""),  # "data" alone is an empty data line
    (b": keep-alive", None),
    (b"retry: 10", None),
])
def test_event_data(raw: bytes, data: bytes | None) -> None:
    assert event_data(raw) == data


lines = st.lists(st.sampled_from([b"data: x", b"data: {\"k\":1}", b": c", b"id: 1", b"",
                                  b"data:", b"data: \xc3\xbc"]), max_size=12)


@settings(max_examples=200, deadline=None)
@given(lines=lines, eol=st.sampled_from([b"\n", b"\r\n", b"\r"]),
       cuts=st.lists(st.integers(0, 200), max_size=6))
def test_any_stream_splits_as_the_spec_reads_it(lines: list[bytes], eol: bytes,
                                                cuts: list[int]) -> None:
    stream = b"".join(line + eol for line in lines)
    expected: list[bytes] = []
    current: list[bytes] = []
    for line in lines:  # the spec, one line at a time
        if line:
            current.append(line)
        elif current:
            expected.append(b"\n".join(current))
            current = []
    got, _ = split_all(stream, [c for c in cuts if c <= len(stream)])
    assert got == expected
