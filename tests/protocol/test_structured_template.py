"""The tiny model's chat template with tools: what it renders for tools, past calls and tool
results, and that a past call is written exactly as the grammar makes the model write it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llguidance
import pytest

from modelfiles.tokenizer import Tokenizer
from protocol.contract import parse
from protocol.errors import BadRequest
from protocol.structured import Structured, parse_tool_calls, structured_of

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
USER = {"role": "user", "content": "Weather in Paris and Oslo?"}
CALLS = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
    {"id": "call_2", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
RESULTS = [{"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
           {"role": "tool", "tool_call_id": "call_2", "content": "rain"}]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def structured(messages: list[dict[str, Any]], **fields: Any) -> Structured:
    return structured_of(parse("chat", {"messages": messages, **fields}))  # type: ignore[arg-type]


def render(tok: Tokenizer, messages: list[dict[str, Any]], **fields: Any) -> str:
    """What the backend renders (and the gateway counts) for this chat."""
    s = structured(messages, **fields)
    return tok.apply_chat_template(s.prompt_messages(messages), tools=s.template_tools())


def test_plain_chats_render_as_before(tok: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "S"}, USER, {"role": "assistant", "content": "A"}]
    assert render(tok, msgs) == (
        "<|begin_of_text|><|im_start|>system\nS<|im_end|>\n<|im_start|>user\n"
        "Weather in Paris and Oslo?<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_tools_are_listed_in_the_system_turn(tok: Tokenizer) -> None:
    text = render(tok, [{"role": "system", "content": "Be brief."}, USER], tools=[WEATHER])
    head = "<|begin_of_text|><|im_start|>system\nBe brief.\n\n# Tools\n"
    assert text.startswith(head)
    assert f"<tools>\n{json.dumps(WEATHER, ensure_ascii=False)}\n</tools>" in text
    assert text.count("<|im_start|>system") == 1  # the system message is in the tools turn
    assert text.endswith("<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n"
                         "<|im_start|>assistant\n")
    assert render(tok, [USER], tools=[WEATHER]).startswith(
        "<|begin_of_text|><|im_start|>system\n# Tools\n")


def test_tool_choice_does_not_change_the_prompt(tok: Tokenizer) -> None:
    texts = {render(tok, [USER], tools=[WEATHER], tool_choice=c)
             for c in ("none", "auto", "required")}
    assert len(texts) == 1


def test_a_schema_instruction_is_rendered(tok: Tokenizer) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    text = render(tok, [USER], response_format=fmt)
    assert text.startswith("<|begin_of_text|><|im_start|>system\nAnswer with one JSON value")
    assert '{"type": "object"}<|im_end|>' in text


def test_past_calls_and_results(tok: Tokenizer) -> None:
    text = render(tok, [USER, CALLS, *RESULTS], tools=[WEATHER])
    turn = ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n')
    results = ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
               "<tool_response>\nrain\n</tool_response><|im_end|>\n")
    assert turn + results + "<|im_start|>assistant\n" in text
    with_content = {**CALLS, "content": "Checking."}
    assert "<|im_start|>assistant\nChecking.\n<tool_call>\n" in render(
        tok, [USER, with_content, *RESULTS], tools=[WEATHER])


def test_a_past_call_is_what_the_grammar_makes_the_model_write(tok: Tokenizer,
                                                               tiny_model_dir: Path) -> None:
    text = render(tok, [USER, CALLS, *RESULTS], tools=[WEATHER])
    start = text.index("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
    written = text[start:text.index("<|im_end|>", start)]
    calls = parse_tool_calls(written)
    assert calls is not None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    grammar = structured([USER], tools=[WEATHER], tool_choice="required").grammar
    assert grammar is not None
    lltok = llguidance.LLTokenizer(str(tiny_model_dir / "tokenizer.json"))
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar),
                                   log_level=0)
    assert matcher.consume_tokens(lltok.tokenize_str(written)) and matcher.is_accepting()


def test_tool_results_need_their_call_id(tok: Tokenizer) -> None:
    with pytest.raises(BadRequest) as info:
        render(tok, [USER, CALLS, {"role": "tool", "content": "sunny"}], tools=[WEATHER])
    assert info.value.param == "messages"
