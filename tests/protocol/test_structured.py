"""protocol.structured: response_format / tools / tool_choice validated (a 400 naming the
field), the messages and tools a chat renders, the grammar chosen, the version stamps."""

from __future__ import annotations

import json
from typing import Any

import pytest

from protocol.contract import parse, parse_tokenize
from protocol.errors import BadRequest
from protocol.structured import (
    NO_STRUCTURE,
    canonical_json,
    sha256_of,
    structured_of,
)
from protocol.versions import short

MSGS = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
NOOP = {"type": "function", "function": {"name": "noop"}}
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}},
          "required": ["b", "a"]}


def chat(**fields: Any) -> Any:
    return structured_of(parse("chat", {"messages": MSGS, **fields}))  # type: ignore[arg-type]


def refused(**fields: Any) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        chat(**fields)
    assert info.value.status == 400
    return info.value


def js(schema: Any = SCHEMA, **extra: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, **extra}}


# ---- 400s, each naming its field ------------------------------------------------------------
@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {}}, "response_format"),
    ({"response_format": {"type": "text", "extra": 1}}, "response_format"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
     "response_format"),
    ({"response_format": js(name_override=1)}, "response_format"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "has space", "schema": SCHEMA}}},
     "response_format"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x" * 65, "schema": SCHEMA}}},
     "response_format"),
    ({"response_format": js([1, 2])}, "response_format"),
    ({"response_format": js("string")}, "response_format"),
    ({"response_format": js(False)}, "response_format"),
    ({"response_format": js(strict="yes")}, "response_format"),
    ({"response_format": js(description=3)}, "response_format"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": ["get_weather"]}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "a.b"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": 1}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "other": 1}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}, "extra": 1}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                          "function": {"name": "get_weather", "x": 1}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"function_call": {"name": "f"}}, "function_call"),
])
def test_bad_input_is_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    assert refused(**fields).param == param


CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
    {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def result(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": "done"}


@pytest.mark.parametrize("messages", [
    [{"role": "tool", "content": "sunny"}],  # no tool_call_id
    [*MSGS, result("c1")],  # no call before it
    [*MSGS, {"role": "assistant", "content": "no calls"}, result("c1")],
    [*MSGS, CALLED, result("c3")],  # not one of the calls' ids
    [*MSGS, CALLED, result("c1"), {"role": "user", "content": "x"}, result("c2")],
    [{"role": "user", "content": "x", "tool_calls": []}],
    [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}],
    [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}],
])
def test_malformed_tool_history_names_messages(messages: list[dict[str, Any]]) -> None:
    with pytest.raises(BadRequest) as info:
        structured_of(parse("chat", {"messages": messages}))  # type: ignore[arg-type]
    assert info.value.param == "messages"


def test_tool_results_answer_the_calls_before_them() -> None:
    history = [*MSGS, CALLED, result("c2"), result("c1"), {"role": "user", "content": "x"},
               {**CALLED, "tool_calls": CALLED["tool_calls"][:1]}, result("c1")]
    assert structured_of(parse("chat", {"messages": history})) == NO_STRUCTURE  # type: ignore[arg-type]


def test_what_asks_nothing_is_no_structure() -> None:
    assert chat() == NO_STRUCTURE
    assert chat(response_format={"type": "text"}) == NO_STRUCTURE
    assert chat(function_call="none", functions=[]) == NO_STRUCTURE
    for choice in ("none", "auto"):  # without tools they ask nothing
        s = chat(tool_choice=choice)
        assert s.grammar is None and not s.calls_tools and s.versions() == {}
    assert chat(parallel_tool_calls=False).grammar is None


# ---- grammars chosen ------------------------------------------------------------------------
def test_json_object_is_any_object() -> None:
    s = chat(response_format={"type": "json_object"})
    assert (s.grammar_kind, s.param, s.response_format) == ("json_schema", "response_format",
                                                            "json_object")
    assert json.loads(s.grammar) == {"type": "object"}
    assert s.versions() == {"schema": sha256_of({"type": "object"})}


@pytest.mark.parametrize("strict", [True, False, None])
def test_json_schema_constrains_strict_or_not(strict: bool | None) -> None:
    s = chat(response_format=js(strict=strict))
    assert s.grammar_kind == "json_schema" and s.param == "response_format"
    assert s.grammar == json.dumps(SCHEMA)  # properties keep their order: b before a
    assert s.schema_sha256 == sha256_of(SCHEMA) and s.tools_sha256 is None


def test_a_schema_of_true_is_any_value() -> None:
    # llguidance applies its options to an object schema only ("true" is refused there)
    assert chat(response_format=js(True)).grammar == "{}"
    beside = chat(tools=[WEATHER], response_format=js(True))
    assert beside.checks[0] == ("json_schema", "{}", "response_format")
    assert beside.grammar is not None and "answer: %json {\"x-guidance\"" in beside.grammar
    assert chat(response_format=js(True)).schema_sha256 == sha256_of(True)  # as sent


def test_a_schema_of_false_is_refused_naming_response_format() -> None:
    err = refused(response_format=js(False))
    assert err.param == "response_format" and "false" in err.message
    assert refused(tools=[WEATHER], tool_choice="required",
                   response_format=js(False)).param == "response_format"


@pytest.mark.parametrize(("choice", "first"), [
    (None, "start: TEXT | head call_rest more*"),
    ("auto", "start: TEXT | head call_rest more*"),
    ("required", 'start: "<tool_call>" call_rest more*'),
    ({"type": "function", "function": {"name": "noop"}}, 'start: "<tool_call>" call_rest more*'),
])
def test_tools_are_a_lark_grammar(choice: Any, first: str) -> None:
    s = chat(tools=[WEATHER, NOOP], **({} if choice is None else {"tool_choice": choice}))
    assert (s.grammar_kind, s.param) == ("lark", "tools") and s.calls_tools
    assert s.grammar is not None and s.grammar.splitlines()[0] == first
    assert s.tool_names == ("get_weather", "noop")
    named = isinstance(choice, dict)
    assert ('"const": "get_weather"' in s.grammar) is not named
    assert s.tool_choice == ("noop" if named else choice or "auto")


def test_parallel_tool_calls_false_is_one_call() -> None:
    s = chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert s.grammar is not None and s.grammar.splitlines()[0] == \
        'start: "<tool_call>" call_rest'
    assert not s.parallel_tool_calls


def test_tool_choice_none_renders_the_tools_and_constrains_nothing() -> None:
    s = chat(tools=[WEATHER], tool_choice="none")
    assert s.grammar is None and not s.calls_tools
    assert s.template_tools() == [WEATHER] == chat(tools=[WEATHER]).template_tools()
    assert s.versions() == {"tools": sha256_of([WEATHER])}
    with_format = chat(tools=[WEATHER], tool_choice="none", response_format=js())
    assert with_format.grammar_kind == "json_schema" and with_format.param == "response_format"


def test_response_format_beside_tools() -> None:
    params = WEATHER["function"]["parameters"]  # type: ignore[index]
    each_alone = [("json_schema", json.dumps(SCHEMA), "response_format"),
                  ("json_schema", json.dumps(params), "tools")]
    auto = chat(tools=[WEATHER], response_format=js())
    assert auto.grammar_kind == "lark" and auto.grammar is not None
    assert auto.grammar.startswith('start: answer | "<tool_call>" call_rest more*')
    assert list(auto.checks) == each_alone  # each field alone, checked first
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        forced = chat(tools=[WEATHER, NOOP], tool_choice=choice, response_format=js())
        assert forced.grammar is not None and "answer" not in forced.grammar
        # the format is the final answer's, not this turn's: not constrained, but checked
        # (what the engine cannot enforce is a 400 naming it in every mode) and stamped
        assert forced.checks[0] == each_alone[0]
        assert forced.instruction is not None and json.dumps(SCHEMA) in forced.instruction
        assert set(forced.versions()) == {"schema", "tools"}


def test_each_called_function_s_parameters_are_checked_alone() -> None:
    """A refusal then names a pointer of the client's own schema, not of the grammar."""
    own = {"type": "object", "x-guidance": {"lenient": False}, "properties": {}}
    tool = {"type": "function", "function": {"name": "own", "parameters": own}}
    noop2 = {"type": "function", "function": {"name": "noop2"}}
    s = chat(tools=[WEATHER, NOOP, noop2, tool])
    assert [c[1] for c in s.checks] == [
        json.dumps(WEATHER["function"]["parameters"]),  # type: ignore[index]
        json.dumps({"type": "object", "properties": {}, "additionalProperties": False}),
        json.dumps({"type": "object", "properties": {}})]  # once each; own options dropped
    assert all(c[::2] == ("json_schema", "tools") for c in s.checks)
    named = chat(tools=[WEATHER, NOOP], tool_choice={"type": "function",
                                                     "function": {"name": "noop"}})
    assert len(named.checks) == 1  # only the function that may be called
    assert chat(tools=[WEATHER], tool_choice="none").checks == ()
    assert chat(response_format=js()).checks == ()  # the grammar is the schema itself


def test_local_references_still_resolve_when_embedded() -> None:
    params = {"$defs": {"Loc": {"type": "object"}}, "type": "object",
              "properties": {"loc": {"$ref": "#/$defs/Loc"}, "self": {"$ref": "#"},
                             "data": {"const": {"$ref": "#/kept"}}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    grammar = chat(tools=[tool]).grammar
    assert grammar is not None
    assert '"$ref": "#/properties/arguments/$defs/Loc"' in grammar
    assert '"$ref": "#/properties/arguments"' in grammar
    assert '{"const": {"$ref": "#/kept"}}' in grammar  # data, not a reference


@pytest.mark.parametrize("where", ["properties", "$defs", "definitions", "patternProperties",
                                   "dependentSchemas"])
@pytest.mark.parametrize("name", ["default", "const", "enum", "examples", "$ref"])
def test_a_property_named_like_a_data_keyword_is_still_a_schema(where: str, name: str) -> None:
    """In a name→schema map every value is a schema: its references are rebased."""
    params = {"type": "object", "$defs": {"Inner": {"type": "integer"}},
              where: {name: {"$ref": "#/$defs/Inner"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    grammar = chat(tools=[tool]).grammar
    assert grammar is not None
    assert f'"{where}": {{"{name}": {{"$ref": "#/properties/arguments/$defs/Inner"}}}}' \
        in grammar
    assert '"#/$defs/Inner"' not in grammar


def test_parameters_without_a_type_are_an_object_and_none_are_no_arguments() -> None:
    untyped = {"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"x": {"type": "integer"}}}}}
    grammar = chat(tools=[untyped, NOOP]).grammar
    assert grammar is not None
    assert '"arguments": {"properties": {"x": {"type": "integer"}}, "type": "object"}' in grammar
    assert ('"arguments": {"type": "object", "properties": {}, "additionalProperties": false}'
            in grammar)


# ---- prompts --------------------------------------------------------------------------------
def test_the_schema_instruction_joins_the_system_message() -> None:
    s = chat(response_format=js())
    assert s.instruction is not None and s.instruction.endswith(json.dumps(SCHEMA))
    msgs = [{"role": "system", "content": "Be brief."}, *MSGS]
    out = s.prompt_messages(msgs)
    assert out[0] == {"role": "system", "content": "Be brief.\n\n" + s.instruction}
    assert out[1] is msgs[1] and msgs[0]["content"] == "Be brief."  # input unchanged
    made = s.prompt_messages(MSGS)
    assert made == [{"role": "system", "content": s.instruction}, *MSGS]
    parts = [{"role": "system", "content": [{"type": "text", "text": "A"}]}, *MSGS]
    assert s.prompt_messages(parts)[0]["content"][-1] == {"type": "text",
                                                         "text": "\n" + s.instruction}
    assert chat(response_format={"type": "json_object"}).prompt_messages(MSGS)[0]["role"] \
        == "system"


def test_without_a_format_the_messages_are_unchanged() -> None:
    assert chat(tools=[WEATHER]).prompt_messages(MSGS) == MSGS
    assert NO_STRUCTURE.template_tools() is None


def test_past_call_arguments_are_parsed_from_their_json_text() -> None:
    history = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
        {"id": "c2", "type": "function",
         "function": {"name": "get_weather", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out = NO_STRUCTURE.prompt_messages(history)
    calls = out[1]["tool_calls"]
    assert calls[0]["function"]["arguments"] == {"city": "Paris"}
    assert calls[1]["function"]["arguments"] == "not json"  # written as given
    assert history[1]["tool_calls"][0]["function"]["arguments"] == '{"city":"Paris"}'


def test_tokenize_requests_render_as_the_chat_would() -> None:
    body = {"messages": MSGS, "tools": [WEATHER], "response_format": js()}
    from_tokenize = structured_of(parse_tokenize(body))
    from_chat = chat(tools=[WEATHER], response_format=js(), tool_choice="required")
    assert from_tokenize.prompt_messages(MSGS) == from_chat.prompt_messages(MSGS)
    assert from_tokenize.template_tools() == from_chat.template_tools()
    assert from_tokenize.versions() == from_chat.versions()


# ---- versions -------------------------------------------------------------------------------
def test_canonical_json_and_its_hash() -> None:
    assert canonical_json({"b": [1, {"d": "é", "c": None}], "a": 1.5}) == \
        '{"a":1.5,"b":[1,{"c":null,"d":"é"}]}'
    assert sha256_of({"a": 1, "b": 2}) == sha256_of({"b": 2, "a": 1})
    assert sha256_of({"a": 1}) != sha256_of({"a": 2})
    assert len(sha256_of([])) == 64


def test_versions_and_the_header_suffix() -> None:
    s = chat(tools=[WEATHER], response_format=js())
    assert s.versions() == {"schema": sha256_of(SCHEMA), "tools": sha256_of([WEATHER])}
    assert s.header_suffix() == (f"; schema={short(sha256_of(SCHEMA))}; "
                                 f"tools={short(sha256_of([WEATHER]))}")
    assert chat(tools=[WEATHER]).header_suffix() == f"; tools={short(sha256_of([WEATHER]))}"
    assert NO_STRUCTURE.header_suffix() == ""
    # key order in the request does not change a stamp; a changed schema does
    reordered = {"required": ["b", "a"], "properties": SCHEMA["properties"], "type": "object"}
    assert chat(response_format=js(reordered)).schema_sha256 == s.schema_sha256
    assert chat(response_format=js({**SCHEMA, "required": ["a"]})).schema_sha256 \
        != s.schema_sha256
