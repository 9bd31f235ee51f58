"""Strict JSON bodies (protocol.json_body) and numeric headers (protocol.http): malformed
input is a BadRequest naming the field or header, never an exception that becomes a 500."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import json_body
from protocol.errors import BadRequest, PayloadTooLarge
from protocol.http import LimitedBody, digits, int_header, parse_json_object
from protocol.json_body import MAX_JSON_DEPTH, loads_strict, loads_strict_checked, nesting_exceeds

SURROGATE = b"\xed\xa0\x80"  # U+D800 encoded as if it were a character: not UTF-8


def refused(raw: bytes) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        parse_json_object(raw)
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value


# ---- Unicode ------------------------------------------------------------------------------
@pytest.mark.parametrize(("raw", "param"), [
    (b'{"prompt": "a\\ud800b"}', "prompt"),
    (b'{"prompt": "a' + SURROGATE + b'b"}', "prompt"),
    (b'{"prompt": "\\uDFFF"}', "prompt"),
    (b'{"prompt": ["ok", "\\ud800"]}', "prompt[1]"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": "' + SURROGATE + b'"}]}',
     "messages[0].content"),
    ((b'{"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": '
      b'[{"type": "text", "text": "x\\udc80"}]}]}'), "messages[1].content[0].text"),
    (b'{"messages": [{"role": "user", "content": "\xff"}]}', "messages[0].content"),
    (b'{"stop": ["\xc3"]}', "stop[0]"),
])
def test_lone_surrogates_and_invalid_utf8_name_the_field(raw: bytes, param: str) -> None:
    err = refused(raw)
    assert err.code == "invalid_unicode" and err.param == param
    assert param in err.message and "Unicode" in err.message


def test_a_bad_key_names_its_object() -> None:
    err = refused(b'{"messages": [{"role": "user", "\\ud800": 1}]}')
    assert (err.code, err.param) == ("invalid_unicode", "messages[0]")
    assert "a key of messages[0]" in err.message
    top = refused(b'{"\\udc80": 1}')
    assert top.param is None and "the body" in top.message


@pytest.mark.parametrize("raw", [b"\xff\xfe", b'{"a": 1}\xff', b"\xfe\xff\x00{\x00}",
                                 b"{\x00}"])
def test_bytes_that_are_not_utf8_json_are_invalid_json(raw: bytes) -> None:
    assert refused(raw).code == "invalid_json"


@pytest.mark.parametrize(("raw", "value"), [
    (b'{"a": "\\ud83d\\ude00"}', "\U0001f600"),  # an escaped pair is one character
    (b'{"a": "\xf0\x9f\x98\x80"}', "\U0001f600"),
    (b'{"a": "\\\\ud800"}', "\\ud800"),  # an escaped backslash: the text "\ud800"
    (b'\xef\xbb\xbf{"a": "bom"}', "bom"),
    (b'{"a": "caf\xc3\xa9 \\u00e9"}', "caf\u00e9 \u00e9"),
])
def test_valid_unicode_passes(raw: bytes, value: str) -> None:
    assert parse_json_object(raw) == {"a": value}


# ---- nesting ------------------------------------------------------------------------------
def nested(depth: int, leaf: bytes = b"1") -> bytes:
    half = depth // 2
    return b'{"a":' * half + b"[" * (depth - half) + leaf + b"]" * (depth - half) \
        + b"}" * half


def test_nesting_is_bounded_before_parsing() -> None:
    limit = MAX_JSON_DEPTH
    assert parse_json_object(b'{"x":' + nested(limit - 1) + b"}")["x"]
    for depth in (limit + 1, 500, 950, 100_000):
        err = refused(b'{"x":' + nested(depth - 1) + b"}")
        assert err.code == "invalid_json" and f"deeper than {limit}" in err.message
    assert refused(b"[" * 60_000).code == "invalid_json"


def test_brackets_inside_strings_do_not_count() -> None:
    text = '[{' * 200 + '"\\"]}' + "\\\\"
    body = json.dumps({"messages": [{"role": "user", "content": text}]}).encode()
    assert parse_json_object(body)["messages"][0]["content"] == text


json_values = st.recursive(
    st.none() | st.integers() | st.text(alphabet='[]{}"\\ab\u00e9', max_size=6),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(alphabet='[]{}"\\k', max_size=3), inner, max_size=3),
    max_leaves=40)


def depth_of(value: Any) -> int:
    """Reference depth (objects and arrays count one level each), iteratively."""
    best, stack = 0, [(value, 0)]
    while stack:
        item, d = stack.pop()
        if isinstance(item, (list, dict)):
            best = max(best, d + 1)
            stack.extend((c, d + 1) for c in (item.values() if isinstance(item, dict)
                                               else item))
    return best


@settings(max_examples=300, deadline=None)
@given(value=json_values, limit=st.integers(0, 8), ascii_only=st.booleans(),
       wrap=st.integers(0, 6))
def test_the_depth_scan_agrees_with_the_parsed_depth(value: Any, limit: int, ascii_only: bool,
                                                     wrap: int) -> None:
    for _ in range(wrap):
        value = [value, {"k": value}]
    raw = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert nesting_exceeds(raw, limit) == (depth_of(value) > limit)


def test_deep_bodies_are_refused_without_recursion() -> None:
    # 4 MB of brackets: refused (or passed) by bytes methods, no RecursionError anywhere
    assert nesting_exceeds(b"[" * 2_000_000 + b"]" * 2_000_000)
    assert not nesting_exceeds(b"[" + b"[]," * 1_000_000 + b"[]]")
    sub = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert not nesting_exceeds(b",".join([sub] * 10_000))
    assert nesting_exceeds(b"[" + b",".join([sub] * 10_000) + b"]")


# ---- numeric headers ----------------------------------------------------------------------
@pytest.mark.parametrize(("raw", "value"), [
    (b"0", 0), (b"42", 42), ("42", 42), (b" 7\t", 7), (b"9" * 18, 10**18 - 1), (None, None),
    (b"", None), (b"\xb2", None), ("\u00b2", None), ("\u0663", None), (b"9" * 19, None),
    (b"9" * 5000, None), (b"-1", None), (b"+1", None), (b"1.5", None), (b"1e3", None),
    (b"1 2", None), ("\u2460", None),
])
def test_digits_are_ascii_and_bounded(raw: bytes | str | None, value: int | None) -> None:
    assert digits(raw) == value


@pytest.mark.parametrize("raw", [b"\xb2", "\u00b2", b"9" * 5000, b"9" * 19, b"", b"0", b"-5",
                                 b"abc", b"1.0"])
def test_a_bad_numeric_header_is_a_400_naming_it(raw: bytes | str) -> None:
    with pytest.raises(BadRequest) as info:
        int_header("x-sluice-deadline-ms", raw, minimum=1)
    assert info.value.param == "x-sluice-deadline-ms"
    assert "x-sluice-deadline-ms" in info.value.message
    assert int_header("x-sluice-deadline-ms", b"250", minimum=1) == 250
    assert int_header("x-sluice-deadline-ms", None, minimum=1) is None


@pytest.mark.parametrize("raw", ["\u00b2", b"\xb2", b"9" * 5000, "1e9", b"-1"])
def test_content_length_must_be_digits(raw: bytes | str) -> None:
    with pytest.raises(BadRequest) as info:
        LimitedBody(10, raw)
    assert info.value.param == "content-length"
    with pytest.raises(PayloadTooLarge):
        LimitedBody(10, b"9" * 18)
    LimitedBody(10, " 10 ").add(b"0123456789")


# ---- the worker's parse: the check first, the same verdicts -------------------------------
def outcome(parse: Any, raw: bytes) -> tuple[str, Any]:
    try:
        return "ok", parse(raw)
    except BadRequest as err:
        return "refused", (err.code, err.param)


@settings(max_examples=300, deadline=None)
@given(value=json_values, wrap=st.integers(0, 80), bad=st.sampled_from([b"", b"\xff", b"]"]))
def test_the_checked_parse_agrees_with_the_strict_one(value: Any, wrap: int,
                                                      bad: bytes) -> None:
    for _ in range(wrap):
        value = [value]
    raw = json.dumps(value).encode() + bad
    assert outcome(lambda r: loads_strict_checked(r, lambda v: None), raw) == \
        outcome(loads_strict, raw)


def test_the_check_refuses_before_the_depth_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    scans: list[int] = []
    monkeypatch.setattr(json_body, "nesting_exceeds",
                        lambda raw, limit: scans.append(len(raw)) or False)

    def at_most_two(value: Any) -> None:
        if len(value) > 2:
            raise BadRequest("too many", "messages", code="invalid_value")

    with pytest.raises(BadRequest) as info:
        loads_strict_checked(json.dumps([[]] * 100).encode(), at_most_two)
    assert info.value.param == "messages" and scans == []
    assert loads_strict_checked(b"[[], []]", at_most_two) == [[], []] and scans == [8]
    # too deep for the server, within orjson's own bound: refused after the check passes
    monkeypatch.undo()
    deep = b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1)
    with pytest.raises(BadRequest) as too_deep:
        loads_strict_checked(deep, lambda v: None)
    assert "deeper than 64" in too_deep.value.message
    with pytest.raises(BadRequest):  # past orjson's bound: the strict path refuses it
        loads_strict_checked(b"[" * 5000 + b"]" * 5000, lambda v: None)
