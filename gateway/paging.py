"""Cursor pagination for the admin API's lists: ``?limit=N&cursor=C``.

A list is read in a stable order of *positions* (a tenant: its id; a key: its ``created``
then its id), and a cursor is the position of the last item a page held, encoded:
base64url (no padding) of the JSON array ``[kind, *position]``. Clients treat it as opaque.

Why a position and not an offset: the next page starts strictly after the position, found
by bisection in the sorted list of the store version the page is read from, so an item
created or deleted between two pages never makes the walk repeat an item or skip one that
was there all along and not touched (an offset would shift under both). An item created
before the cursor's position is not seen by that walk; one created after it is.

A page is ``{"object": "list", "data", "has_more", "first_id", "last_id", "next_cursor"}``
(OpenAI's list shape plus ``next_cursor``, null exactly when ``has_more`` is false).
"""

from __future__ import annotations

import base64
import binascii
import json
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from .errors import BadRequest

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
MAX_CURSOR_CHARS = 512  # the longest real one (a 64-character tenant id) is ~100
PARAMS = ("limit", "cursor")

Kind = Literal["tenants", "keys"]
Position = tuple[Any, ...]  # tenants: (id,); keys: (created, id)
T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class PageQuery:
    limit: int
    after: Position | None  # None: from the start


def page_query(params: Sequence[tuple[str, str]], kind: Kind) -> PageQuery:
    """The page a query string asks for; BadRequest naming the parameter otherwise."""
    seen: dict[str, str] = {}
    for name, value in params:
        if name not in PARAMS:
            raise BadRequest(f"unknown query parameter {name!r}; a list takes "
                             f"{' and '.join(PARAMS)}", name, code="unknown_parameter")
        if name in seen:
            raise BadRequest(f"{name!r} is given more than once", name, code="invalid_value")
        seen[name] = value
    return PageQuery(_limit(seen.get("limit")),
                     None if "cursor" not in seen else decode_cursor(kind, seen["cursor"]))


def _limit(text: str | None) -> int:
    if text is None:
        return DEFAULT_LIMIT
    # isascii first: str.isdigit() is true of other scripts' digits too
    if text.isascii() and text.isdigit() and len(text) <= 6 and 1 <= int(text) <= MAX_LIMIT:
        return int(text)
    raise BadRequest(f"limit must be a whole number from 1 to {MAX_LIMIT}, got {text[:20]!r}",
                     "limit", code="invalid_value")


def encode_cursor(kind: Kind, position: Position) -> str:
    raw = json.dumps([kind, *position], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def decode_cursor(kind: Kind, cursor: str) -> Position:
    """The position a cursor of this list holds; BadRequest (``param: cursor``) for anything
    else: not one this API made, or one of the other list."""
    try:
        if not cursor or len(cursor) > MAX_CURSOR_CHARS or not cursor.isascii():
            raise ValueError
        raw = base64.b64decode(cursor + "=" * (-len(cursor) % 4), altchars=b"-_",
                               validate=True)
        value = json.loads(raw)
    except (ValueError, binascii.Error):  # UnicodeDecodeError, JSONDecodeError included
        value = None
    if isinstance(value, list) and value and value[0] == kind and _fits(kind, value[1:]):
        return tuple(value[1:])
    raise BadRequest("cursor is not a cursor of this list; pass a next_cursor this list "
                     "returned, or leave it out to start at the beginning", "cursor",
                     code="invalid_value")


def _fits(kind: Kind, position: list[Any]) -> bool:
    if kind == "tenants":
        return len(position) == 1 and isinstance(position[0], str)
    return (len(position) == 2 and type(position[0]) is int  # not bool
            and isinstance(position[1], str))


@dataclass(slots=True, frozen=True)
class Page:
    data: list[dict[str, Any]]
    has_more: bool
    next_cursor: str | None

    def body(self) -> dict[str, Any]:
        return {"object": "list", "data": self.data, "has_more": self.has_more,
                "first_id": self.data[0]["id"] if self.data else None,
                "last_id": self.data[-1]["id"] if self.data else None,
                "next_cursor": self.next_cursor}


def page(kind: Kind, query: PageQuery, items: Sequence[T], position: Callable[[T], Position],
         shown: Callable[[T], dict[str, Any] | None]) -> Page:
    """The page of ``items`` (sorted by ``position``, which is unique) after the query's
    position: up to ``limit`` items that ``shown`` renders; those it refuses (None) are
    skipped. ``has_more`` is exact: it looks ahead for one more item ``shown`` renders.

    Costs O(log n) to find the start plus the items rendered: nothing is copied.
    """
    start = 0 if query.after is None else bisect_right(items, query.after, key=position)
    data: list[dict[str, Any]] = []
    last: T | None = None
    i = start
    while i < len(items) and len(data) < query.limit:
        rendered = shown(items[i])
        if rendered is not None:
            data.append(rendered)
            last = items[i]
        i += 1
    has_more = any(shown(items[j]) is not None for j in range(i, len(items)))
    cursor = encode_cursor(kind, position(last)) if has_more and last is not None else None
    return Page(data, has_more, cursor)

