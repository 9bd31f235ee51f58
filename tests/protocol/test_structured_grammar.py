"""The grammars protocol.structured builds, run in llguidance with the tiny model's tokenizer:
they compile without warnings, accept what they must and refuse what they must."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llguidance
import pytest

from protocol.contract import parse
from protocol.structured import Structured, structured_of

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"], "additionalProperties": False}}}
NOOP = {"type": "function", "function": {"name": "noop"}}
NESTED = {"type": "function", "function": {"name": "move", "parameters": {
    "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}},
                        "required": ["x"], "additionalProperties": False}},
    "type": "object", "properties": {"to": {"$ref": "#/$defs/Point"}}, "required": ["to"],
    "additionalProperties": False}}}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}


def call(name: str, args: dict[str, Any]) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


PARIS = call("get_weather", {"city": "Paris"})
TWO = PARIS + "\n" + call("noop", {})


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(str(tiny_model_dir / "tokenizer.json"))


def structured(**fields: Any) -> Structured:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return structured_of(parse("chat", body))  # type: ignore[arg-type]


def compiled(s: Structured, tokenizer: llguidance.LLTokenizer) -> str:
    """As the engine compiles it (backend/engine/grammar.py): a schema compact and lenient,
    any warning a refusal."""
    assert s.grammar is not None
    if s.grammar_kind == "json_schema":
        text = llguidance.LLMatcher.grammar_from_json_schema(
            s.grammar, {"whitespace_flexible": False}, {"lenient": True})
    else:
        text = llguidance.LLMatcher.grammar_from_lark(s.grammar)
    assert llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer) == (False, [])
    return text


def run(grammar: str, tokenizer: llguidance.LLTokenizer, text: str) -> llguidance.LLMatcher:
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    matcher.consume_tokens(tokenizer.tokenize_str(text))
    return matcher


def accepts(grammar: str, tokenizer: llguidance.LLTokenizer, text: str) -> bool:
    matcher = run(grammar, tokenizer, text)
    return not matcher.is_error() and matcher.is_accepting()


def test_auto_accepts_free_text_and_calls_and_nothing_else(
        tokenizer: llguidance.LLTokenizer) -> None:
    g = compiled(structured(tools=[WEATHER, NOOP]), tokenizer)
    for good in ("It is sunny.", "a < b and <tool_cal", PARIS, TWO,
                 "Let me look.\n" + PARIS, call("get_weather", {"city": "Oslo", "days": 2})):
        assert accepts(g, tokenizer, good), good
    for bad in ("",  # at least one character
                call("get_weather", {"city": 3}),  # wrong argument type
                call("get_weather", {"days": 1}),  # a required argument missing
                call("get_weather", {"city": "x", "extra": 1}),
                call("unknown", {}),
                PARIS.replace(", ", ","),  # the format's separators
                PARIS + " and more text",  # nothing after the calls
                "text <tool_call> more text"):  # free text never holds the tag
        assert not accepts(g, tokenizer, bad), bad


def test_required_is_calls_only(tokenizer: llguidance.LLTokenizer) -> None:
    g = compiled(structured(tools=[WEATHER, NOOP], tool_choice="required"), tokenizer)
    assert accepts(g, tokenizer, PARIS) and accepts(g, tokenizer, TWO)
    assert not accepts(g, tokenizer, "It is sunny.")
    assert not accepts(g, tokenizer, "Sure.\n" + PARIS)


def test_a_named_function_is_that_function_only(tokenizer: llguidance.LLTokenizer) -> None:
    choice = {"type": "function", "function": {"name": "noop"}}
    g = compiled(structured(tools=[WEATHER, NOOP], tool_choice=choice), tokenizer)
    assert accepts(g, tokenizer, call("noop", {}))
    assert not accepts(g, tokenizer, PARIS)
    assert not accepts(g, tokenizer, call("noop", {"x": 1}))  # no parameters: no arguments


def test_one_call_when_parallel_calls_are_off(tokenizer: llguidance.LLTokenizer) -> None:
    g = compiled(structured(tools=[WEATHER, NOOP], parallel_tool_calls=False), tokenizer)
    matcher = run(g, tokenizer, PARIS)
    assert matcher.is_accepting() and matcher.is_stopped()  # the engine finishes here
    assert not accepts(g, tokenizer, TWO)
    assert not run(compiled(structured(tools=[WEATHER]), tokenizer), tokenizer,
                   PARIS).is_stopped()  # a second call may follow


def test_references_inside_parameters_hold(tokenizer: llguidance.LLTokenizer) -> None:
    g = compiled(structured(tools=[NESTED], tool_choice="required"), tokenizer)
    assert accepts(g, tokenizer, call("move", {"to": {"x": 1.5}}))
    assert not accepts(g, tokenizer, call("move", {"to": {"y": 1}}))


def test_a_parameter_named_default_holding_a_reference(tokenizer: llguidance.LLTokenizer) \
        -> None:
    """A property named like a data keyword is a schema: its $ref resolves embedded."""
    params = {"type": "object", "$defs": {"Inner": {"type": "integer"}},
              "properties": {"default": {"$ref": "#/$defs/Inner"}}, "required": ["default"],
              "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    g = compiled(structured(tools=[tool], tool_choice="required"), tokenizer)
    assert accepts(g, tokenizer, call("f", {"default": 3}))
    assert not accepts(g, tokenizer, call("f", {"default": "3"}))


def test_a_schema_of_true_compiles_as_any_value(tokenizer: llguidance.LLTokenizer) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": True}}
    for fields in ({}, {"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "required"}):
        s = structured(response_format=fmt, **fields)
        for kind, source, _param in s.checks:
            compiled(Structured(grammar_kind=kind, grammar=source), tokenizer)
        g = compiled(s, tokenizer)
        if not fields:
            assert accepts(g, tokenizer, "[1,\"a\"]") and accepts(g, tokenizer, "3")


def test_json_formats(tokenizer: llguidance.LLTokenizer) -> None:
    g = compiled(structured(response_format={"type": "json_object"}), tokenizer)
    assert accepts(g, tokenizer, '{"a":[1,2]}')
    assert not accepts(g, tokenizer, "[1]") and not accepts(g, tokenizer, "hello")
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": False}}
    g = compiled(structured(response_format=fmt), tokenizer)
    assert accepts(g, tokenizer, '{"n":3}')
    assert not accepts(g, tokenizer, '{"n":"3"}') and not accepts(g, tokenizer, "{}")


def test_a_format_beside_tools_is_that_json_or_calls(tokenizer: llguidance.LLTokenizer) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    s = structured(tools=[WEATHER], response_format=fmt)
    g = compiled(s, tokenizer)
    assert accepts(g, tokenizer, '{"n":3}') and accepts(g, tokenizer, PARIS)
    assert not accepts(g, tokenizer, "free text") and not accepts(g, tokenizer, '{"n":"x"}')
    assert not accepts(g, tokenizer, "Sure.\n" + PARIS)
    for kind, source, _param in s.checks:  # each part alone compiles too
        part = Structured(grammar_kind=kind, grammar=source)
        compiled(part, tokenizer)


def test_what_the_library_cannot_enforce_is_a_warning(tokenizer: llguidance.LLTokenizer) -> None:
    # the engine refuses a grammar with warnings (a 400 naming the field): never loosened
    odd = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"oneOf": [
            {"type": "string"}, {"type": "string", "minLength": 2}]}}}}}
    s = structured(tools=[odd])
    assert s.grammar is not None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        llguidance.LLMatcher.grammar_from_lark(s.grammar), tokenizer)
    assert not failed and any("oneOf" in m for m in messages)
