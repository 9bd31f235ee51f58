"""protocol.tool_calls: tool calls read out of output text, whole and streamed (split at
every point), as OpenAI's tool_calls and tool_calls deltas."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from protocol.tool_calls import (
    ToolCall,
    ToolCallStream,
    new_call_id,
    parse_tool_calls,
    split_tool_calls,
)


def call(name: str, args: Any) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


TRICKY = {"s": 'br}ace"s] and {\\ "esc', "n": [1, {"d": []}], "u": "é"}
TWO = call("get_weather", {"city": "Paris"}) + "\n" + call("noop", {})


def feed_all(pieces: list[str]) -> tuple[str, list[dict[str, Any]], ToolCallStream]:
    """(content, deltas, stream) after feeding ``pieces`` and closing."""
    stream = ToolCallStream(ids())
    content, deltas = [], []
    for piece in [*(stream.feed(p) for p in pieces), stream.close()]:
        content.append(piece.content)
        deltas.extend(piece.tool_calls)
    return "".join(content), deltas, stream


def reassemble(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a client (the OpenAI SDK) builds from tool_calls deltas."""
    calls: list[dict[str, Any]] = []
    for d in deltas:
        if "id" in d:
            assert d["index"] == len(calls) and d["type"] == "function"
            assert d["function"]["arguments"] == ""
            calls.append({"id": d["id"], "type": "function",
                          "function": {"name": d["function"]["name"], "arguments": ""}})
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return calls


def splits(text: str) -> Iterator[list[str]]:
    """The text whole, one character at a time, and cut in two at every point."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


def test_whole_parse() -> None:
    text = "Let me check.\n\n" + call("get_weather", TRICKY) + "\n" + call("noop", {})
    assert split_tool_calls(text, ids()) == ("Let me check.", [
        ToolCall("call_0", "get_weather", json.dumps(TRICKY)), ToolCall("call_1", "noop", "{}")])
    assert parse_tool_calls(TWO, ids()) == [
        ToolCall("call_0", "get_weather", '{"city": "Paris"}'), ToolCall("call_1", "noop", "{}")]
    assert split_tool_calls(TWO)[0] is None  # type: ignore[index]
    assert ToolCall("c", "f", "{}").to_openai() == {
        "id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def test_text_that_is_not_whole_calls_is_none() -> None:
    for text in ("plain text", "", call("f", {"a": 1})[:-3],  # cut short
                 call("f", {"a": 1}) + " trailing", call("f", [1]),  # arguments not an object
                 '<tool_call>\n{"arguments": {}, "name": "f"}\n</tool_call>',
                 "<tool_call>\n{}\n</tool_call>"):
        assert parse_tool_calls(text) is None, text


def test_every_split_streams_the_same_calls_as_the_whole() -> None:
    text = "Sure <b>.\n" + call("get_weather", TRICKY) + "\n" + call("noop", {})
    whole = [c.to_openai() for c in parse_tool_calls(text, ids()) or []]
    assert len(whole) == 2
    for pieces in splits(text):
        content, deltas, stream = feed_all(pieces)
        assert content == "Sure <b>."
        assert reassemble(deltas) == whole, pieces
        assert stream.complete


def test_content_is_never_part_of_an_opening_tag() -> None:
    text = "a <tool_c b <\n" + call("f", {})
    for pieces in splits(text):
        stream = ToolCallStream(ids())
        sent = ""
        for p in pieces:
            sent += stream.feed(p).content
            assert "<tool_call" not in sent and not sent.endswith(("\n", " "))
        sent += stream.close().content
        assert sent == "a <tool_c b <"


def test_free_text_streams_as_content() -> None:
    text = "x < y\n\n and <tool_cal  \n"
    for pieces in splits(text):
        content, deltas, stream = feed_all(pieces)
        assert (content, deltas, stream.complete) == (text, [], False)


def test_deltas_are_openai_shaped_and_merged_per_feed() -> None:
    stream = ToolCallStream(ids())
    one = call("f", {"a": 1})
    cut = one.index("1") + 1
    first = stream.feed(one[:cut])
    assert first.tool_calls == [
        {"index": 0, "id": "call_0", "type": "function",
         "function": {"name": "f", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"a": 1'}}]
    rest = stream.feed(one[cut:] + "\n" + call("g", {}))
    assert rest.tool_calls == [
        {"index": 0, "function": {"arguments": "}"}},
        {"index": 1, "id": "call_1", "type": "function",
         "function": {"name": "g", "arguments": ""}},
        {"index": 1, "function": {"arguments": "{}"}}]
    assert not stream.close() and stream.complete


def test_output_cut_inside_a_call_keeps_the_partial_call() -> None:
    # finish_reason "length": the call so far, as OpenAI streams it
    text = call("f", {"a": "long text"})
    text = text[:text.index("t\"")]
    content, deltas, stream = feed_all([text])
    assert content == "" and not stream.complete
    assert reassemble(deltas)[0]["function"]["arguments"] == '{"a": "long tex'
    cut_in_head = "ok\n<tool_call>\n{\"na"
    content, deltas, stream = feed_all(list(cut_in_head))
    assert (content, deltas) == (cut_in_head, [])  # nothing lost


def test_text_that_breaks_the_format_is_content() -> None:
    text = "<tool_call>\nnot json\n</tool_call>"
    for pieces in splits(text):
        content, deltas, _ = feed_all(pieces)
        assert (content, deltas) == (text, [])


def test_ids_are_unique() -> None:
    assert len({new_call_id() for _ in range(1000)}) == 1000
    assert new_call_id().startswith("call_") and len(new_call_id()) == 29


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8),
                      st.floats(allow_nan=False, allow_infinity=False))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=10)
arguments = st.dictionaries(st.text(max_size=6), json_value, max_size=4)
names = st.from_regex(r"[a-zA-Z0-9_-]{1,12}", fullmatch=True)


@given(st.lists(st.tuples(names, arguments), min_size=1, max_size=3), st.data())
def test_any_calls_round_trip_however_streamed(calls: list[tuple[str, dict[str, Any]]],
                                               data: st.DataObject) -> None:
    text = "\n".join(call(name, args) for name, args in calls)
    parsed = parse_tool_calls(text)
    assert parsed is not None
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    content, deltas, stream = feed_all(pieces)
    assert content == "" and stream.complete
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in reassemble(deltas)] == calls
