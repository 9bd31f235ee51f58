"""The spliced SSE chunks equal the OpenAI chunk objects encoded whole (no server needed)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from backend.engine.outputs import OutputDelta
from backend.engine.sampling import SamplingParams
from backend.server.service import Prepared
from backend.server.sse import ChunkEncoder
from protocol.sse import DONE

TEXTS = ["Hello", " wor", 'ld "quoted" \\ back', "tab\tnew\nline", "\x00\x1f\x7f",
         "é日本\u2028\u2029", "🙂"]


def prepared(kind: str, include_usage: bool, continuous: bool) -> Prepared:
    return Prepared(kind=kind, request_id="r1", prompt_ids=[5, 6, 7],  # type: ignore[arg-type]
                    params=SamplingParams(max_tokens=8), priority=0, cache_salt=None,
                    stream=True, include_usage=include_usage, model="sluice-tiny",
                    fingerprint="fp_x", continuous_usage=continuous, created=1700000000)


def delta(text: str, n: int, finished: bool = False) -> OutputDelta:
    return OutputDelta("r1", text, (9,), (0.0,), finished, "length" if finished else None,
                       3, 1, n)


def usage(n: int) -> dict[str, Any]:
    return {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n,
            "prompt_tokens_details": {"cached_tokens": 1}}


def reference(p: Prepared, text: str, n: int) -> dict[str, Any]:
    """The content chunk as OpenAI shapes it, key order included."""
    chat = p.kind == "chat"
    choice: dict[str, Any] = {"index": 0}
    choice.update({"delta": {"content": text}} if chat else {"text": text})
    choice.update({"logprobs": None, "finish_reason": None})
    obj: dict[str, Any] = {
        "id": ("chatcmpl-" if chat else "cmpl-") + "r1",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 1700000000, "model": "sluice-tiny", "system_fingerprint": "fp_x",
        "choices": [choice]}
    if p.include_usage:
        obj["usage"] = usage(n) if p.continuous_usage else None
    return obj


def parse(event: bytes) -> list[Any]:
    assert event.endswith(b"\n\n")
    out = []
    for part in event.decode().split("\n\n")[:-1]:
        assert part.startswith("data: ")
        out.append(part[6:] if part == "data: [DONE]" else json.loads(part[6:]))
    return out


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize(("include_usage", "continuous"),
                         [(False, False), (True, False), (True, True)])
def test_text_chunks_equal_the_whole_objects(kind: str, include_usage: bool,
                                             continuous: bool) -> None:
    p = prepared(kind, include_usage, continuous)
    enc = ChunkEncoder(p)
    for n, text in enumerate(TEXTS, 1):
        raw = enc.text(text, delta(text, n))
        expected = reference(p, text, n)
        # the same bytes as encoding the object whole (compact, non-ASCII kept)
        body = json.dumps(expected, ensure_ascii=False, separators=(",", ":"))
        assert raw == b"data: " + body.encode() + b"\n\n"
        assert parse(raw) == [expected]


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_final_carries_reason_usage_and_done(kind: str) -> None:
    p = prepared(kind, include_usage=True, continuous=False)
    events = parse(ChunkEncoder(p).final(delta("end", 8, finished=True)))
    last, usage_event, done = events
    choice = last["choices"][0]
    assert choice["finish_reason"] == "length"
    assert (choice["delta"]["content"] if kind == "chat" else choice["text"]) == "end"
    assert last["usage"] is None
    assert usage_event["choices"] == [] and usage_event["usage"] == usage(8)
    assert done == DONE[6:-2].decode()
