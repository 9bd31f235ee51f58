"""backend/server/tool_calls.py without an engine: the whole and the streamed answer of
outputs that may hold tool calls, choice by choice, split at every point; the versions on
the request's span."""

from __future__ import annotations

import itertools
import json
from typing import Any

from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from backend.engine.outputs import OutputDelta
from backend.engine.sampling import SamplingParams
from backend.server.service import Prepared
from backend.server.sse import Choice, ChunkEncoder, whole_response
from backend.server.tool_calls import ToolCallEncoder, tool_call_message
from backend.server.tracing import RequestRecord, request_attributes
from protocol.contract import parse
from protocol.sse import EventSplitter, event_data
from protocol.structured import Structured, sha256_of, structured_of

TOOLS = [{"type": "function", "function": {"name": "f"}},
         {"type": "function", "function": {"name": "g"}}]


def call(name: str, args: dict[str, Any]) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def ids() -> Any:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def prepared(n: int = 1, **fields: Any) -> Prepared:
    body = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, **fields}
    return Prepared(kind="chat", request_id="r", prompt_ids=[1, 2], params=SamplingParams(n=n),
                    priority=0, cache_salt=None, stream=True, include_usage=True,
                    model="m", fingerprint="fp_x",
                    structured=structured_of(parse("chat", body)))  # type: ignore[arg-type]


def delta(text: str, index: int = 0, reason: str | None = None,
          finished: bool = False) -> OutputDelta:
    return OutputDelta("r", text, (), (), finished, reason, 2, 0, 5, index=index)


def chunks(data: bytes) -> list[dict[str, Any]]:
    events = [event_data(e) for e in EventSplitter().feed(data)]
    return [json.loads(e) for e in events if e is not None and e != b"[DONE]"]


TEXT_0 = call("f", {"a": [1, "}"]}) + "\n" + call("g", {})
TEXT_1 = "no calls < here"


def test_whole_message() -> None:
    message, reason = tool_call_message(TEXT_0, "stop", ids())
    assert reason == "tool_calls" and message == {
        "role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "f", "arguments": '{"a": [1, "}"]}'}},
            {"id": "call_1", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}
    assert tool_call_message(TEXT_1, "stop") == (
        {"role": "assistant", "content": TEXT_1, "refusal": None}, "stop")
    cut, reason = tool_call_message("Hi.\n" + TEXT_0[:40], "length", ids())
    assert reason == "length" and cut["content"] == "Hi."  # the partial call, as streamed
    assert cut["tool_calls"][0]["function"]["arguments"] == TEXT_0[TEXT_0.index("{\"a"):40]


def test_whole_response_reads_each_choice() -> None:
    p = prepared(n=2)
    choices = [Choice(parts=[TEXT_0], finish_reason="stop"),
               Choice(parts=[TEXT_1], finish_reason="length")]
    body = whole_response(p, choices, delta("", finished=True, reason="length"))
    first, second = body["choices"]
    assert first["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in first["message"]["tool_calls"]] == ["f", "g"]
    assert second == {"index": 1, "message": {"role": "assistant", "content": TEXT_1,
                                              "refusal": None},
                      "logprobs": None, "finish_reason": "length"}


def test_without_tools_the_answer_is_content() -> None:
    p = prepared(tool_choice="none")
    assert not p.structured.calls_tools
    body = whole_response(p, [Choice(parts=[TEXT_0], finish_reason="stop")],
                          delta("", finished=True, reason="stop"))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": TEXT_0,
                                             "refusal": None}


def stream(p: Prepared, pieces: list[list[str]], reasons: list[str]) -> list[dict[str, Any]]:
    """Stream choice i's pieces (interleaved), ending each with reasons[i]."""
    enc = ToolCallEncoder(ChunkEncoder(p), ids())
    out = enc.first() or b""
    for i, choice in enumerate(pieces):
        for text in choice[:-1]:
            out += enc.text(text, delta(text, i))
    for i, choice in enumerate(pieces):
        last = i == len(pieces) - 1
        d = delta(choice[-1], i, reasons[i], finished=last)
        out += enc.final(d) if last else enc.end(d)
    assert out.endswith(b"data: [DONE]\n\n")
    return chunks(out)


def assemble(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for e in events:
        for c in e["choices"]:
            got = out.setdefault(c["index"], {"content": "", "calls": [], "reason": None})
            got["content"] += c["delta"].get("content") or ""
            for d in c["delta"].get("tool_calls", []):
                if "id" in d:
                    got["calls"].append([d["function"]["name"], ""])
                got["calls"][d["index"]][1] += d["function"]["arguments"]
            got["reason"] = c["finish_reason"] or got["reason"]
    return out


def test_streams_match_the_whole_answer_at_every_split() -> None:
    whole, _ = tool_call_message(TEXT_0, "stop", ids())
    want = [[c["function"]["name"], c["function"]["arguments"]] for c in whole["tool_calls"]]
    for cut in range(1, len(TEXT_0)):
        for cut1 in (1, 7):
            events = stream(prepared(n=2), [[TEXT_0[:cut], TEXT_0[cut:]],
                                            [TEXT_1[:cut1], TEXT_1[cut1:]]], ["stop", "stop"])
            got = assemble(events)
            assert got[0] == {"content": "", "calls": want, "reason": "tool_calls"}, cut
            assert got[1] == {"content": TEXT_1, "calls": [], "reason": "stop"}
            usage = [e for e in events if not e["choices"]]
            assert len(usage) == 1 and usage[0]["usage"]["completion_tokens"] == 5


def test_the_last_chunk_of_a_choice_is_an_empty_delta() -> None:
    events = stream(prepared(), [list(TEXT_0)], ["stop"])
    finals = [e["choices"][0] for e in events if e["choices"]
              and e["choices"][0]["finish_reason"]]
    assert finals == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}]
    first_call = next(e["choices"][0]["delta"] for e in events
                      if e["choices"] and "tool_calls" in e["choices"][0]["delta"])
    assert first_call == {"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                                          "function": {"name": "f", "arguments": ""}}]}


NAMED = {"type": "function", "function": {"name": "g"}}


def sdk_message(events: list[dict[str, Any]]) -> Any:
    """The message the official SDK accumulates from these chunks."""
    state: ChatCompletionStreamState[None] = ChatCompletionStreamState()
    for e in events:
        state.handle_chunk(ChatCompletionChunk.model_validate(e))
    return state.get_final_completion().choices[0].message


def test_a_calls_only_stream_opens_with_null_content_as_openai_s() -> None:
    """required / a named function: the answer can only be calls, so the opening delta is
    OpenAI's ``content: null``, and the SDK's accumulated message has content None."""
    for choice in ("required", NAMED):
        events = stream(prepared(n=2, tool_choice=choice), [[TEXT_0], [TEXT_0]],
                        ["stop", "stop"])
        opening = [e["choices"][0] for e in events[:2]]
        assert [c["delta"] for c in opening] == [{"role": "assistant", "content": None}] * 2
        assert [c["index"] for c in opening] == [0, 1]
        message = sdk_message(events)
        assert message.content is None and [c.function.name for c in message.tool_calls] \
            == ["f", "g"]
    # under auto the answer may be text: the opening delta is a text stream's
    auto = stream(prepared(), [[TEXT_1]], ["stop"])
    assert auto[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert sdk_message(auto).content == TEXT_1


def test_a_cut_call_keeps_the_engine_s_finish_reason() -> None:
    got = assemble(stream(prepared(), [[TEXT_0[:45]]], ["length"]))[0]
    assert got["reason"] == "length" and got["calls"][0][0] == "f"


def test_the_span_carries_the_schema_and_tools_versions() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    p = prepared(response_format=fmt)
    rec = RequestRecord("r", "chat", "t", 0.0, None)
    rec.p = p
    attrs = request_attributes(rec, {})
    assert attrs["sluice.schema_sha256"] == sha256_of({"type": "object"})
    assert attrs["sluice.tools_sha256"] == sha256_of(TOOLS)
    rec.p = prepared(tools=None)
    rec.p.structured = Structured()
    assert not any(k.startswith(("sluice.schema", "sluice.tools"))
                   for k in request_attributes(rec, {}))
