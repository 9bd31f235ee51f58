"""OpenAI response bodies, streamed (SSE chunks) and whole.

Per-token chunks are the hot path: each is a precomputed byte prefix + the JSON-escaped text
+ a precomputed suffix, so a token costs one C call to escape a short string and a join.
"""

from __future__ import annotations

from json.encoder import encode_basestring
from typing import Any

from backend.engine.outputs import OutputDelta
from protocol.sse import DONE, dumps, event

from .service import Prepared

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

    __slots__ = ("_envelope", "_head", "_tail", "_tail_open", "p")

    def __init__(self, p: Prepared) -> None:
        self.p = p
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
            head = env + ',"choices":[{"index":0,"delta":{"content":'
            tail = '},"logprobs":null,"finish_reason":null}]'
        else:
            head = env + ',"choices":[{"index":0,"text":'
            tail = ',"logprobs":null,"finish_reason":null}]'
        self._tail_open = tail.encode()  # for continuous usage: the usage object follows
        if p.include_usage:
            tail += ',"usage":null'
        self._head = b"data: " + head.encode()
        self._tail = (tail + "}\n\n").encode()

    def first(self) -> bytes | None:
        """The opening chunk: chat announces the assistant role; completions send nothing."""
        if self.p.kind != "chat":
            return None
        return self._chunk({"role": "assistant", "content": ""}, None)

    def text(self, text: str, delta: OutputDelta | None = None) -> bytes:
        if delta is not None and self.p.continuous_usage:
            return (self._head + quote(text).encode() + self._tail_open + b',"usage":'
                    + dumps(usage(delta)).encode() + b"}\n\n")
        return self._head + quote(text).encode() + self._tail

    def final(self, delta: OutputDelta) -> bytes:
        """The last content chunk (with finish_reason), the usage chunk if asked, [DONE]."""
        reason = delta.finish_reason
        running = delta if self.p.continuous_usage else None
        if self.p.kind == "chat":
            body = {"content": delta.text} if delta.text else {}
            out = self._chunk(body, reason, running)
        else:
            out = self._chunk(delta.text, reason, running)
        if self.p.include_usage:
            out += event({**self._envelope, "choices": [], "usage": usage(delta)})
        return out + DONE

    def _chunk(self, content: object, reason: str | None,
               running: OutputDelta | None = None) -> bytes:
        if self.p.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": content, "logprobs": None,
                                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": reason}
        obj: dict[str, Any] = {**self._envelope, "choices": [choice]}
        if self.p.include_usage:
            obj["usage"] = None if running is None else usage(running)
        return event(obj)


def whole_response(p: Prepared, text: str, final: OutputDelta) -> dict[str, Any]:
    """The non-streaming body."""
    if p.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": final.finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None,
                  "finish_reason": final.finish_reason}
        obj = "text_completion"
    return {
        "id": p.response_id, "object": obj, "created": p.created, "model": p.model,
        "system_fingerprint": p.fingerprint, "choices": [choice], "usage": usage(final),
    }
