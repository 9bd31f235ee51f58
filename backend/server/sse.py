"""OpenAI response bodies, streamed (SSE chunks) and whole.

Per-token chunks are the hot path: each is a precomputed byte prefix + the JSON-escaped text
+ a precomputed suffix, so a token costs one C call to escape a short string and a join.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from json.encoder import encode_basestring
from typing import Any

from backend.engine.outputs import OutputDelta, TokenLogprob
from protocol.sse import DONE, dumps, event

from .logprobs import Entries, LogprobFormat
from .service import Prepared
from .tool_calls import tool_call_message

# What ``dumps`` does with a str (ensure_ascii=False), without its Python frame.
quote = encode_basestring


def usage(delta: OutputDelta) -> dict[str, Any]:
    return {
        "prompt_tokens": delta.num_prompt_tokens,
        "completion_tokens": delta.num_output_tokens,
        "total_tokens": delta.num_prompt_tokens + delta.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": delta.num_cached_tokens},
    }


class ChunkEncoder:
    """SSE events for one streamed request (chat or completion)."""

    __slots__ = ("_envelope", "_heads", "_offset", "_tail", "_tail_open", "lp", "p")

    def __init__(self, p: Prepared, logprob_format: LogprobFormat | None = None) -> None:
        self.p = p
        self.lp = logprob_format  # for requests that ask for logprobs
        self._offset = [0] * p.params.n  # completions: each choice's next text_offset
        chat = p.kind == "chat"
        self._envelope: dict[str, Any] = {
            "id": p.response_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": p.created,
            "model": p.model,
            "system_fingerprint": p.fingerprint,
        }
        # Everything of a content chunk but the text, as bytes around it.
        env = dumps(self._envelope)[:-1]  # drop the closing brace
        if chat:
            head = ',"delta":{"content":'
            tail = '},"logprobs":null,"finish_reason":null}]'
        else:
            head = ',"text":'
            tail = ',"logprobs":null,"finish_reason":null}]'
        self._tail_open = tail.encode()  # for continuous usage: the usage object follows
        if p.include_usage:
            tail += ',"usage":null'
        self._heads = [f'data: {env},"choices":[{{"index":{i}{head}'.encode()
                       for i in range(p.params.n)]
        self._tail = (tail + "}\n\n").encode()

    def first(self, content: str | None = "") -> bytes | None:
        """The opening chunk: chat announces the assistant role (``content``: "", or None
        where the answer can only be tool calls, as OpenAI sends); completions send
        nothing."""
        if self.p.kind != "chat":
            return None
        return b"".join(self._chunk({"role": "assistant", "content": content}, None, index=i)
                        for i in range(self.p.params.n))

    def text(self, text: str, delta: OutputDelta | None = None) -> bytes:
        head = self._heads[0 if delta is None else delta.index]
        if delta is not None and self.p.continuous_usage:
            return (head + quote(text).encode() + self._tail_open + b',"usage":'
                    + dumps(usage(delta)).encode() + b"}\n\n")
        return head + quote(text).encode() + self._tail

    def with_logprobs(self, text: str, delta: OutputDelta, entries: Entries) -> bytes:
        """A content chunk with the logprobs of ``entries`` (the tokens since the last)."""
        running = delta if self.p.continuous_usage else None
        content = {"content": text} if self.p.kind == "chat" else text
        return self._chunk(content, None, running, self._logprobs(entries, delta.index),
                           delta.index)

    def end(self, delta: OutputDelta, entries: Entries = ()) -> bytes:
        """A choice's last content chunk, with its finish_reason and the logprobs of
        ``entries``."""
        reason = delta.finish_reason
        running = delta if self.p.continuous_usage else None
        lps = self._logprobs(entries, delta.index) if entries else None
        if self.p.kind == "chat":
            body = {"content": delta.text} if delta.text else {}
            return self._chunk(body, reason, running, lps, delta.index)
        return self._chunk(delta.text, reason, running, lps, delta.index)

    def final(self, delta: OutputDelta, entries: Entries = ()) -> bytes:
        """The request's last delta: its choice's last chunk (``end``), the usage chunk if
        asked, [DONE]."""
        return self.end(delta, entries) + self.closing(delta)

    def closing(self, delta: OutputDelta) -> bytes:
        """What follows the last choice's last chunk: the usage chunk if asked, [DONE]."""
        if self.p.include_usage:
            return event({**self._envelope, "choices": [], "usage": usage(delta)}) + DONE
        return DONE

    def delta(self, body: dict[str, Any], index: int, reason: str | None = None,
              running: OutputDelta | None = None,
              entries: Entries | None = None) -> bytes:
        """A chat chunk of choice ``index`` with this ``delta`` object (tool calls), its
        finish_reason, and the logprobs of ``entries`` when asked."""
        lps = self._logprobs(entries, index) if entries else None
        running = running if self.p.continuous_usage else None
        return self._chunk(body, reason, running, lps, index)

    def _logprobs(self, entries: Entries, index: int = 0) -> dict[str, Any] | None:
        if self.lp is None:
            return None
        if self.p.kind == "chat":
            return self.lp.chat(entries)
        obj, self._offset[index] = self.lp.completion(entries, self._offset[index])
        return obj

    def _chunk(self, content: object, reason: str | None,
               running: OutputDelta | None = None,
               logprobs: dict[str, Any] | None = None, index: int = 0) -> bytes:
        if self.p.kind == "chat":
            choice: dict[str, Any] = {"index": index, "delta": content, "logprobs": logprobs,
                                      "finish_reason": reason}
        else:
            choice = {"index": index, "text": content, "logprobs": logprobs,
                      "finish_reason": reason}
        obj: dict[str, Any] = {**self._envelope, "choices": [choice]}
        if self.p.include_usage:
            obj["usage"] = None if running is None else usage(running)
        return event(obj)


@dataclass(slots=True)
class Choice:
    """One choice of a whole response, as its deltas arrive."""

    parts: list[str] = field(default_factory=list)
    entries: list[tuple[int, TokenLogprob]] = field(default_factory=list)  # (token, logprob)
    finish_reason: str | None = None

    def add(self, delta: OutputDelta) -> None:
        if delta.text:
            self.parts.append(delta.text)
        if delta.logprobs is not None:
            self.entries.extend(zip(delta.token_ids, delta.logprobs))
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason


def whole_response(p: Prepared, choices: list[Choice], final: OutputDelta,
                   logprobs: list[dict[str, Any] | None] | None = None) -> dict[str, Any]:
    """The non-streaming body: ``choices`` in index order (``logprobs``: each choice's,
    when asked for); ``final``, the request's last delta, has the usage of them all."""
    out: list[dict[str, Any]] = []
    for i, c in enumerate(choices):
        lps = logprobs[i] if logprobs is not None else None
        if p.kind == "chat" and p.structured.calls_tools:
            message, reason = tool_call_message("".join(c.parts), c.finish_reason)
            out.append({"index": i, "message": message, "logprobs": lps,
                        "finish_reason": reason})
        elif p.kind == "chat":
            message = {"role": "assistant", "content": "".join(c.parts), "refusal": None}
            out.append({"index": i, "message": message, "logprobs": lps,
                        "finish_reason": c.finish_reason})
        else:
            out.append({"index": i, "text": "".join(c.parts), "logprobs": lps,
                        "finish_reason": c.finish_reason})
    obj = "chat.completion" if p.kind == "chat" else "text_completion"
    return {
        "id": p.response_id, "object": obj, "created": p.created, "model": p.model,
        "system_fingerprint": p.fingerprint, "choices": out, "usage": usage(final),
    }
