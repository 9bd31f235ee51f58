"""SSE framing: the splitter against the spec's line ends, chunk boundaries and fields, and
a property test against a reference parser written from the WHATWG algorithm."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import ServiceUnavailable
from protocol.sse import (
    DONE,
    EventFields,
    EventSplitter,
    EventTooLong,
    dumps,
    error_event,
    event,
    event_data,
    parse_event,
)


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


BOM = b"\xef\xbb\xbf"


def test_a_leading_bom_is_dropped_at_any_split() -> None:
    """Only the stream's first BOM goes; one later is part of a field name (ignored)."""
    stream = BOM + b"data: a\r\n\r\n" + BOM + b"data: b\n\ndata: c\n\n"
    whole, _ = split_all(stream)
    assert whole == [b"data: a", BOM + b"data: b", b"data: c"]
    assert [event_data(e) for e in whole] == [b"a", None, b"c"]
    for a in range(len(stream) + 1):
        for b in range(a, len(stream) + 1):
            assert split_all(stream, [a, b]) == (whole, 0), (a, b)


def test_a_bom_cut_short_is_data() -> None:
    s = EventSplitter()
    assert s.feed(b"\xef") == [] and s.feed(b"") == [] and s.feed(b"\xbb") == []
    assert s.pending == 2
    assert s.feed(b"data: x\n\n") == [b"\xef\xbbdata: x"]  # not a BOM: kept


@pytest.mark.parametrize(("raw", "fields"), [
    (b"data: {}", EventFields(data=b"{}")),
    (b"event: ping\ndata: 1\nid: 7\nretry: 30", EventFields(b"ping", b"1", b"7", 30)),
    (b"event\ndata", EventFields(data=b"")),  # no colon: the whole line names the field
    (b"event:\ndata:x", EventFields(data=b"x")),  # an empty type is "message"
    (b"event:  e \ndata:  y ", EventFields(b" e ", b" y ")),  # one space is dropped
    (b"data: a\n: note\ndata\ndata: b", EventFields(data=b"a\n\nb")),
    (b"id: 1\nid: a\x00b", EventFields(id=b"1")),  # an id with NUL is ignored
    (b"id", EventFields(id=b"")),  # an empty id resets it
    (b"retry: 1x\nretry: \nretry: -1\nretry:5", EventFields(retry=5)),
    (b"retry: 7\nretry: +8\nretry: \xd9\xa3", EventFields(retry=7)),  # ASCII digits only
    (b"Data: no\n data: no\ndata : no\nfoo: bar", EventFields()),
    (b": only a comment", EventFields()),
])
def test_parse_event(raw: bytes, fields: EventFields) -> None:
    assert parse_event(raw) == fields


# ---- the property: any split of any stream reads as the WHATWG algorithm reads it ----------

Dispatched = tuple[str, str, str, int | None]  # type, data, last event id, reconnection time


def whatwg(stream: bytes) -> list[Dispatched]:
    """html.spec.whatwg.org "Interpreting an event stream", step by step, over the whole
    stream at once: the events dispatched, each with the last event ID and the reconnection
    time then in effect."""
    text = stream.decode("utf-8", errors="replace")
    text = text.removeprefix("\ufeff")
    out: list[Dispatched] = []
    data, event_type, last_id, retry = "", "", "", None
    at = 0
    while True:
        ends = [i for i in (text.find("\r", at), text.find("\n", at)) if i >= 0]
        if not ends:
            break  # an unended line at the end of the stream is discarded
        end = min(ends)
        line = text[at:end]
        at = end + (2 if text.startswith("\r\n", end) else 1)
        if not line:  # dispatch
            if data:
                out.append((event_type or "message", data.removesuffix("\n"), last_id, retry))
            data = event_type = ""
            continue
        if line.startswith(":"):
            continue
        if ":" in line:
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
        else:
            name, value = line, ""
        if name == "event":
            event_type = value
        elif name == "data":
            data += value + "\n"
        elif name == "id" and "\0" not in value:
            last_id = value
        elif name == "retry" and value and all(c in "0123456789" for c in value):
            retry = int(value)
    return out


def interpret(events: list[bytes]) -> list[Dispatched]:
    """The splitter's events through ``parse_event``, with what the spec carries over from
    one event to the next (the last event ID, the reconnection time)."""
    out: list[Dispatched] = []
    last_id, retry = b"", None
    for e in events:
        f = parse_event(e)
        last_id = last_id if f.id is None else f.id
        retry = retry if f.retry is None else f.retry
        if f.data is not None:
            out.append((f.type.decode(errors="replace"), f.data.decode(errors="replace"),
                        last_id.decode(errors="replace"), retry))
    return out


values = st.text(st.characters(blacklist_characters="\r\n", blacklist_categories=["Cs"]),
                 max_size=6)  # anything but a line end: colons, spaces, NUL, U+FEFF
spec_lines = st.one_of(
    st.just(""), st.just(""),  # blank lines, often
    st.builds("data{}{}".format, st.sampled_from([":", ": ", ":  "]), values),
    st.builds(lambda v: f'data: {{"content": {v!r}}}', values),
    st.sampled_from(["data", "event", "id", "retry", "data: [DONE]", ":", ": keep-alive",
                     "retry: 3000", "retry: 1x", "id: a\0b", "DATA: x", " data: x", "\ufeffdata: x"]),
    st.builds("{}{}{}".format, st.sampled_from(["event", "id", "retry", ":", "other"]),
              st.sampled_from([":", ": "]), values | st.integers(0, 99999).map(str)),
)


@st.composite
def spec_streams(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    stream = BOM if draw(st.booleans()) else b""
    for line in draw(st.lists(spec_lines, max_size=16)):
        stream += line.encode() + draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))
    cuts = draw(st.lists(st.integers(0, len(stream)), max_size=8))
    return stream, cuts


@settings(max_examples=400, deadline=None)
@given(spec_streams())
def test_any_split_reads_as_the_whatwg_algorithm(case: tuple[bytes, list[int]]) -> None:
    stream, cuts = case
    whole, _ = split_all(stream)
    assert split_all(stream, cuts)[0] == whole
    assert interpret(whole) == whatwg(stream)
