"""Answers that may hold tool calls (a chat with ``tools``, ``tool_choice`` not "none").

The output text is read by ``protocol.tool_calls.ToolCallStream``, whole or as it streams,
so both answers of one output carry the same calls (ids aside). A choice whose text holds a
call answers ``message.tool_calls`` (content: the text before the calls, or null), and when
its output ended after a whole call, ``finish_reason: "tool_calls"`` in place of "stop"; a
choice without calls is plain content, as any chat. Streamed, a call's first delta carries
its id, type and name (arguments ""), the next ones pieces of its arguments, as OpenAI sends
them; then a last chunk with an empty delta and the finish_reason. Where the answer can only
be calls (``tool_choice`` required or a named function) the opening delta is
``{"role": "assistant", "content": null}``, as OpenAI's (its content stays null in a
client's accumulated message); under ``auto`` the answer may be text: ``"content": ""``.
A whole message carries ``"refusal": null``, as OpenAI's always do.

Requests without tools never come here: their per-token path stays ``ChunkEncoder.text``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from backend.engine.outputs import OutputDelta
from protocol.tool_calls import StreamPiece, ToolCallStream, new_call_id

from .logprobs import Entries

if TYPE_CHECKING:
    from .sse import ChunkEncoder


def finish_reason(stream: ToolCallStream, reason: str | None) -> str | None:
    """``tool_calls`` for an output that stopped after a whole call, else the engine's."""
    return "tool_calls" if reason == "stop" and stream.complete else reason


def tool_call_message(text: str, reason: str | None,
                      new_id: Callable[[], str] = new_call_id) -> tuple[dict[str, Any],
                                                                        str | None]:
    """(message, finish_reason) of a whole choice whose output ``text`` may hold calls."""
    stream = ToolCallStream(new_id)
    content = stream.feed(text).content + stream.close().content
    calls = stream.calls
    if not calls:
        return {"role": "assistant", "content": text, "refusal": None}, reason
    return ({"role": "assistant", "content": content or None, "refusal": None,
             "tool_calls": [c.to_openai() for c in calls]}, finish_reason(stream, reason))


class ToolCallEncoder:
    """``ChunkEncoder``'s streaming methods, for outputs read as tool calls: text becomes
    content and ``tool_calls`` deltas as it becomes certain (``ToolCallStream``)."""

    __slots__ = ("_pending", "_streams", "enc")

    def __init__(self, enc: ChunkEncoder, new_id: Callable[[], str] = new_call_id) -> None:
        self.enc = enc
        self._streams = [ToolCallStream(new_id) for _ in range(enc.p.params.n)]
        # per choice, logprobs of tokens whose text is held back: they go with the next chunk
        self._pending: list[list[Any]] = [[] for _ in range(enc.p.params.n)]

    def first(self) -> bytes | None:
        return self.enc.first(None if self.enc.p.structured.calls_only else "")

    def text(self, text: str, delta: OutputDelta) -> bytes:
        return self._chunks(self._streams[delta.index].feed(text), delta)

    def with_logprobs(self, text: str, delta: OutputDelta, entries: Entries) -> bytes:
        self._pending[delta.index].extend(entries)
        return self.text(text, delta)

    def end(self, delta: OutputDelta, entries: Entries = ()) -> bytes:
        """A choice's last chunks: what its text and the end make certain, then an empty
        delta with the finish_reason (and the logprobs not sent yet)."""
        i = delta.index
        stream = self._streams[i]
        self._pending[i].extend(entries)
        out = self._chunks(stream.feed(delta.text), delta) if delta.text else b""
        out += self._chunks(stream.close(), delta)
        left, self._pending[i] = self._pending[i], []
        reason = finish_reason(stream, delta.finish_reason)
        return out + self.enc.delta({}, i, reason, delta, left)

    def final(self, delta: OutputDelta, entries: Entries = ()) -> bytes:
        return self.end(delta, entries) + self.enc.closing(delta)

    def _chunks(self, piece: StreamPiece, delta: OutputDelta) -> bytes:
        """One chunk for the content, then one per tool_calls delta (OpenAI's shape)."""
        if not piece:
            return b""
        i = delta.index
        bodies: list[dict[str, Any]] = []
        if piece.content:
            bodies.append({"content": piece.content})
        bodies.extend({"tool_calls": [d]} for d in piece.tool_calls)
        out = []
        for body in bodies:
            entries, self._pending[i] = self._pending[i], []
            out.append(self.enc.delta(body, i, None, delta, entries))
        return b"".join(out)
