"""Strict JSON request bodies: UTF-8, valid Unicode, bounded nesting; a 400, never a 500.

Python's ``json`` passes on what a server must refuse:

- ``json.loads(bytes)`` decodes with ``surrogatepass``, so the UTF-8 encoding of a lone
  surrogate (``ED A0 80``) becomes one, and the escape ``"\\ud800"`` does too. Such a string
  cannot be encoded again: the tokenizer, the relay or a JSON response fails on it later.
- It recurses once per level of nesting, as pydantic, the chat template and the tokenizer do
  after it: a body nested a few hundred deep passes ``json.loads`` and overflows later.

So ``loads_strict`` refuses, with a ``BadRequest``:

- nesting deeper than ``MAX_JSON_DEPTH`` (64), checked before ``json.loads`` and without
  recursion (``nesting_exceeds``). Tool schemas nest 10-20 deep; 64 leaves them room.
- bytes that are not UTF-8 (a UTF-8 BOM is skipped) and lone surrogates, naming the field by
  its JSON path (``messages[0].content``) in ``param``, with ``code: invalid_unicode``.

Cost on the hot path (a ~1 KB chat body: 1-2 µs over ``json.loads``): two ``bytes.count``
calls bound the depth (the number of ``[`` and ``{`` bytes bounds it, so only bodies with more
than 64 of them are scanned); the UTF-8 decode is the one ``json.loads`` would do anyway; a
search for ``\\u`` + ``d``/``D`` (only in a body with a backslash) decides whether the parsed
tree is walked, iteratively, for lone surrogates: it occurs for an escaped lone surrogate
or an escaped pair (an emoji from a client that escapes non-ASCII). The field's path is only
worked out once a bad string is found.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable
from itertools import accumulate, chain, repeat
from operator import add, sub
from typing import Any

import orjson

from .errors import BadRequest

MAX_JSON_DEPTH = 64
_DECODER = json.JSONDecoder()  # what json.loads(str) uses, minus its argument checks

_AS_SQUARE = bytes.maketrans(b"{}", b"[]")
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD]")  # "\ud800".."\udfff", or one of a pair
_SURROGATE = re.compile("[\ud800-\udfff]")


def nesting_exceeds(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text ``raw`` nests deeper than ``limit``. Exact for valid JSON (and
    never recurses); invalid JSON may be called too deep, which refuses it all the same.

    Only bodies with more than ``limit`` bracket bytes are scanned (their count bounds the
    depth), and then only with C-speed bytes methods, never a Python step per byte:
    ``_brackets`` keeps the brackets outside strings; passes that delete every innermost
    ``[]`` pair (a leaf) lower a balanced sequence's depth by exactly one each, and run
    while they shrink it by a quarter or more; ``_max_depth`` reads the rest run by run. So
    a 4 MB body of brackets costs tens of ms, less than ``json.loads`` spends on it.
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    seq = _brackets(raw)
    removed = 0
    while seq and removed <= limit and seq.count(b"[]") * 8 > len(seq):
        seq = seq.replace(b"[]", b"")
        removed += 1
    return removed + _max_depth(seq) > limit


def _brackets(raw: bytes) -> bytes:
    """The brackets of ``raw`` outside strings, ``{}`` as ``[]``. Escaped backslashes, then
    escaped quotes are deleted (pairing backslashes left to right is how JSON reads a run of
    them), so every ``"`` left delimits a string; then all but quotes and brackets; then
    adjacent quotes, which keeps every other byte's parity (inside a string or not); a
    split drops what the quotes left still enclose (brackets inside strings)."""
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    seq = raw.translate(_AS_SQUARE, _NOT_STRUCTURE).replace(b'""', b"")
    if b'"' in seq:
        seq = b"".join(seq.split(b'"')[::2])
    return seq


def _max_depth(seq: bytes) -> int:
    """The deepest prefix of a bracket sequence. Split at each ``][``, every piece is a run
    of ``[`` then a run of ``]`` (the split's two bytes cancel out), so the depth peaks in
    piece i at (the net of the pieces before it) + (its opening run)."""
    pieces = seq.split(b"][")
    opens: list[int] = list(map(bytes.count, pieces, repeat(b"[")))
    nets = map(sub, map(add, opens, opens), map(len, pieces))  # opens - closes
    peak: int = max(map(add, chain((0,), accumulate(nets)), opens))
    return peak


def _too_deep(max_depth: int) -> BadRequest:
    return BadRequest(f"the body nests deeper than {max_depth} levels (or its brackets do "
                      "not balance)", code="invalid_json")


def loads_strict(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``raw`` parsed as JSON (see the module docstring); raises ``BadRequest``."""
    if nesting_exceeds(raw, max_depth):
        raise _too_deep(max_depth)
    try:
        # orjson takes strict UTF-8 without lone surrogates, escaped or not: what it
        # accepts is what the checks below accept, 1-4x faster (docs/gateway.md)
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass  # the standard parser takes a BOM, NaN, integers past 64 bits, or names the error
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _not_utf8(raw, exc) from None
    text = text.removeprefix("\ufeff")
    try:
        value = _DECODER.decode(text)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if b"\\" in raw and _ESCAPED_SURROGATE.search(raw) and _has_surrogate(value):
        raise _bad_text(value, "an escaped lone UTF-16 surrogate")
    return value


def loads_strict_checked(raw: bytes, check: Callable[[Any], None],
                         max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``loads_strict`` then ``check(value)``, with the check run first where orjson parses
    the body: for a worker process, where orjson's own recursion bound (1024 levels, an
    error past it) is safe, and a check that refuses (120k messages) spares the depth scan
    (~13 ms of a 4 MB body). A body both too deep and refused by ``check`` gets either 400."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        value = loads_strict(raw, max_depth)
        check(value)
        return value
    check(value)
    if nesting_exceeds(raw, max_depth):
        raise _too_deep(max_depth)
    return value


def require_object(value: Any) -> dict[str, Any]:
    """``value`` if it is a JSON object (a request body must be), else ``BadRequest``."""
    if not isinstance(value, dict):
        raise BadRequest("the body must be a JSON object", code="invalid_json")
    return value


def _has_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            for key, child in item.items():
                if not key.isascii() and _SURROGATE.search(key):
                    return True
                stack.append(child)
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _bad_text(value: Any, what: str) -> BadRequest:
    where, in_key = first_bad_text(value) or ("", False)
    field = where or "the body"
    message = f"{'a key of ' if in_key else ''}{field} is not valid Unicode ({what})"
    return BadRequest(message, where or None, code="invalid_unicode")


def first_bad_text(value: Any) -> tuple[str, bool] | None:
    """The JSON path (``messages[0].content``) of the first string or key, in document order,
    holding a lone surrogate, and whether it is a key (the path then names its object)."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path, False
        elif isinstance(item, dict):
            children = []
            for key, child in item.items():
                if _SURROGATE.search(key):
                    return path, True
                children.append((child, f"{path}.{key}" if path else key))
            stack.extend(reversed(children))
        elif isinstance(item, list):
            stack.extend((item[i], f"{path}[{i}]") for i in range(len(item) - 1, -1, -1))
    return None


def _not_utf8(raw: bytes, exc: UnicodeDecodeError) -> BadRequest:
    """Invalid UTF-8: name the field it is in, when the rest of the body is valid JSON."""
    raw = raw.removeprefix(codecs.BOM_UTF8)
    try:
        # each invalid byte becomes a lone surrogate (U+DC80 + byte), found by path below
        value = json.loads(raw.decode("utf-8", "surrogateescape"))
    except (ValueError, RecursionError):
        value = None
    if value is not None and first_bad_text(value) is not None:
        return _bad_text(value, f"invalid UTF-8 {exc.object[exc.start:exc.end]!r}")
    return BadRequest(f"the body is not valid UTF-8 JSON (byte {exc.start}: {exc.reason})",
                      code="invalid_json")
