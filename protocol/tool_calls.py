"""Tool calls in a model's output text, read as OpenAI ``tool_calls`` (whole or streamed).

The text format (Hermes / Qwen style; what the chat template renders for an assistant's
``tool_calls``, and what the engine's grammar allows, ``protocol.structured``)::

    [free text]<tool_call>
    {"name": "NAME", "arguments": {...}}
    </tool_call>
    <tool_call>
    ...
    </tool_call>

Calls are separated by one "\\n"; the JSON is compact with spaces (", " and ": "), the name
first. Free text may precede the first call (``tool_choice: auto``); it is the message's
``content`` with its trailing whitespace dropped.

One state machine, ``ToolCallStream``, reads both: fed text deltas, it returns the content
and OpenAI's ``tool_calls`` delta objects as they become certain (the first delta of a call
carries its id, type and name with empty arguments, the next ones pieces of the arguments'
JSON text); a whole answer is the same machine fed all at once, so the streamed and the
whole answer of one output are the same calls, ids aside. The arguments string is the
output's own JSON text of the arguments object.

States: TEXT (content; a tail that may begin an opening tag is held back, and trailing
whitespace) → HEAD (``\\n{"name": "NAME", "arguments": `` expected) → ARGS (the arguments'
JSON, until the wrapper's closing brace at depth 0 outside strings) → TAIL (``\\n</tool_call>``)
→ AFTER (done; ``\\n<tool_call>`` starts the next call: HEAD). Text that breaks the format
(RAW: not reachable under the grammar) is passed on as content, so that nothing is lost.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_HEAD = '\n{"name": "'
_HEAD_END = '", "arguments": '
_TAIL = "\n" + CALL_CLOSE
_NEXT = "\n" + CALL_OPEN
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
_TEXT, _HEAD_S, _ARGS, _TAIL_S, _AFTER, _RAW = range(6)


def new_call_id() -> str:
    """``call_`` + 24 random hex characters (OpenAI's ids have this shape)."""
    return "call_" + secrets.token_hex(12)


@dataclass(slots=True, frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments object as JSON text

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True, frozen=True)
class StreamPiece:
    """What one ``feed`` (or ``close``) makes certain: content, then tool_calls deltas."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


class ToolCallStream:
    """Reads tool calls out of streamed output text (see the module docstring)."""

    __slots__ = ("_args", "_buf", "_content", "_deltas", "_depth", "_escape", "_held",
                 "_ids", "_in_string", "_names", "_new_id", "_state")

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self._new_id = new_id
        self._state = _TEXT
        self._buf = ""  # text not yet decided on
        self._held = ""  # whitespace dropped before the first opening tag
        self._names: list[str] = []
        self._ids: list[str] = []
        self._args: list[list[str]] = []
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._content: list[str] = []  # this piece's
        self._deltas: list[dict[str, Any]] = []

    # ---- results ----------------------------------------------------------------------
    @property
    def calls(self) -> list[ToolCall]:
        """Every call begun so far (the last one's arguments may be partial)."""
        return [ToolCall(i, n, "".join(a)) for i, n, a in zip(self._ids, self._names,
                                                               self._args, strict=True)]

    @property
    def complete(self) -> bool:
        """At least one call, and the text ends after a whole call."""
        return self._state == _AFTER and not self._buf

    # ---- feeding ----------------------------------------------------------------------
    def feed(self, text: str) -> StreamPiece:
        """The content and deltas that ``text`` (the next piece of output) makes certain."""
        self._buf += text
        self._run(final=False)
        return self._piece()

    def close(self) -> StreamPiece:
        """The output has ended: what was held back (content), or a broken tail as content."""
        self._run(final=True)
        if self._buf or self._held:
            if self._state == _TEXT:
                self._content.append(self._buf)
            elif self._state in (_HEAD_S, _TAIL_S, _AFTER, _RAW):
                self._content.append(self._held + self._buf)
            # ARGS: the arguments were sent as they came; nothing is held
            self._buf = self._held = ""
        return self._piece()

    def _piece(self) -> StreamPiece:
        content = "".join(self._content)
        deltas = self._deltas
        self._content, self._deltas = [], []
        return StreamPiece(content, deltas)

    def _run(self, final: bool) -> None:
        while self._buf:
            before = (self._state, len(self._buf))
            step = (self._text, self._head, self._arguments, self._tail, self._after,
                    self._raw)[self._state]
            step(final)
            if (self._state, len(self._buf)) == before:
                return  # waiting for more text

    def _text(self, final: bool) -> None:
        buf = self._buf
        at = buf.find(CALL_OPEN)
        if at >= 0:
            text = buf[:at]
            kept = text.rstrip()
            if kept:
                self._content.append(kept)
            self._held = text[len(kept):] + CALL_OPEN  # given back if the call breaks
            self._buf = buf[at + len(CALL_OPEN):]
            self._state = _HEAD_S
            return
        if final:
            return
        cut = len(buf)
        for k in range(max(0, len(buf) - len(CALL_OPEN) + 1), len(buf)):
            if CALL_OPEN.startswith(buf[k:]):
                cut = k
                break
        cut = len(buf[:cut].rstrip())
        if cut:
            self._content.append(buf[:cut])
            self._buf = buf[cut:]

    def _head(self, final: bool) -> None:
        buf = self._buf
        n = len(_HEAD)
        if not _HEAD.startswith(buf[:n]):
            self._break()
            return
        if len(buf) <= n:
            return
        end = n
        while end < len(buf) and buf[end] in _NAME_CHARS:
            end += 1
        tail = buf[end:end + len(_HEAD_END)]
        if not _HEAD_END.startswith(tail) or (end == n and tail):
            self._break()
            return
        if len(tail) < len(_HEAD_END):
            return
        index = len(self._names)
        name = buf[n:end]
        self._names.append(name)
        self._ids.append(self._new_id())
        self._args.append([])
        self._deltas.append({"index": index, "id": self._ids[-1], "type": "function",
                             "function": {"name": name, "arguments": ""}})
        self._buf = buf[end + len(_HEAD_END):]
        self._held = ""
        self._depth, self._in_string, self._escape = 0, False, False
        self._state = _ARGS

    def _arguments(self, final: bool) -> None:
        buf = self._buf
        depth, in_string, escape = self._depth, self._in_string, self._escape
        end = -1
        for i, ch in enumerate(buf):
            if in_string:
                if escape:
                    escape = False
                elif ch == "\\":
                    escape = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                if depth == 0:
                    end = i
                    break
                depth -= 1
        piece = buf if end < 0 else buf[:end]
        if piece:
            index = len(self._names) - 1
            self._args[index].append(piece)
            last = self._deltas[-1] if self._deltas else None
            if last is not None and last["index"] == index and "id" not in last:
                last["function"]["arguments"] += piece  # one delta per feed and call
            else:
                self._deltas.append({"index": index, "function": {"arguments": piece}})
        self._depth, self._in_string, self._escape = depth, in_string, escape
        if end < 0:
            self._buf = ""
            return
        self._buf = buf[end + 1:]  # the wrapper's closing brace
        self._state = _TAIL_S

    def _tail(self, final: bool) -> None:
        self._expect(_TAIL, _AFTER)

    def _after(self, final: bool) -> None:
        self._expect(_NEXT, _HEAD_S)

    def _expect(self, literal: str, then: int) -> None:
        buf = self._buf
        if not literal.startswith(buf[:len(literal)]):
            self._break()
        elif len(buf) >= len(literal):
            self._buf = buf[len(literal):]
            self._state = then
            if then == _HEAD_S:
                self._held = literal

    def _raw(self, final: bool) -> None:
        self._content.append(self._buf)
        self._buf = ""

    def _break(self) -> None:
        """The text left the format: from here on it is content, as written."""
        self._buf = self._held + self._buf
        self._held = ""
        self._state = _RAW


def split_tool_calls(text: str, new_id: Callable[[], str] = new_call_id) \
        -> tuple[str | None, list[ToolCall]] | None:
    """(content before the calls or None, calls) when ``text`` is free text then one or more
    whole calls whose arguments are JSON objects; None otherwise."""
    stream = ToolCallStream(new_id)
    content = stream.feed(text).content + stream.close().content
    calls = stream.calls
    if not stream.complete:
        return None
    for call in calls:
        try:
            args = json.loads(call.arguments)
        except (ValueError, RecursionError):
            return None
        if not isinstance(args, dict):
            return None
    return content or None, calls


def parse_tool_calls(text: str, new_id: Callable[[], str] = new_call_id) \
        -> list[ToolCall] | None:
    """The calls in ``text`` (``split_tool_calls``, the content aside), or None."""
    split = split_tool_calls(text, new_id)
    return None if split is None else split[1]
