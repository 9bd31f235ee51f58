"""Structured outputs and tool calls: what ``response_format``, ``tools``, ``tool_choice`` and
``parallel_tool_calls`` ask of a chat, validated (a 400 naming the field), and what they
mean for it: the messages the model sees (``prompt_messages``), the tools its chat template
renders (``template_tools``), the grammar its output must follow, and the versions stamped
on the answer (``versions``). The gateway counts prompts and the backend renders them with
the same two methods, so both see the same text.

The grammar is text (a JSON Schema, or a Lark grammar in llguidance's dialect where
``%json{...}`` embeds one: ``tool_grammar.py``; the tool-call text format and its reading:
``tool_calls.py``); the engine compiles it (``backend/engine/grammar.py``), and
refuses with a 400 naming ``param`` what its library cannot enforce (an embedded schema is
``lenient``: what it cannot enforce comes back as warnings, which the engine refuses). A
``response_format`` answer is JSON without whitespace, as the engine compiles a schema; a
tool call's JSON has ``", "`` between items and ``": "`` after keys, as the chat template
writes past calls (``tojson``), and no other whitespace.

Decisions (docs/backend.md#structured-outputs-and-tool-calls):

- ``strict`` true or false: both constrain the output to the schema (false only makes it
  optional in OpenAI's API; here it is never loosened).
- ``tool_choice: "none"``: the tools are still rendered (as OpenAI does: the model knows of
  them) but nothing is constrained and the output is never read as calls. ``template_tools``
  is therefore the same for every ``tool_choice``: a count needs no ``tool_choice``.
- ``tool_choice`` ``"none"``/``"auto"`` without tools ask nothing and are accepted;
  ``"required"`` or a named function without tools is a 400.
- ``response_format`` with ``tools``: under ``auto`` the answer is either calls or JSON
  of the format; under ``required``/a named function the turn is calls only (the format is
  that of the final answer, a later turn; its instruction is still in the prompt). In every
  mode the format's schema is checked (a schema the engine cannot enforce is a 400 naming
  ``response_format``) and stamped (``schema=``): it is part of the request.
- ``schema: true`` is any JSON value (compiled as ``{}``); ``false`` matches none: a 400.
- A ``role: "tool"`` message answers a call of the assistant message before it (tool
  results in between aside): its ``tool_call_id`` is one of that message's call ids, else
  a 400 naming ``messages``, as OpenAI answers.
- ``parallel_tool_calls: false``: exactly one call per turn; true (the default): one or more.
- Legacy ``functions``/``function_call`` are refused (400) rather than ignored.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from . import tool_grammar as grammars
from .contract import ChatRequest, TokenizeRequest
from .errors import BadRequest
from .tool_calls import (
    CALL_CLOSE,
    CALL_OPEN,
    ToolCall,
    ToolCallStream,
    parse_tool_calls,
    split_tool_calls,
)
from .versions import short

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = [
    "CALL_CLOSE", "CALL_OPEN", "JSON_OBJECT_SCHEMA", "NO_STRUCTURE", "GrammarKind", "Structured",
    "ToolCall", "ToolCallStream", "canonical_json", "parse_tool_calls", "sha256_of",
    "split_tool_calls", "structured_of",
]

GrammarKind = Literal["json_schema", "lark"]
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_CHOICES = ("none", "auto", "required")
# What a json_object format constrains to (and is hashed as, by the gateway too).
JSON_OBJECT_SCHEMA: Mapping[str, Any] = {"type": "object"}
_OBJECT_INSTRUCTION = "Answer with one JSON object and nothing else."
_SCHEMA_INSTRUCTION = ("Answer with one JSON value that matches this JSON Schema, and nothing "
                       "else:\n")


def canonical_json(value: Any) -> str:
    """One spelling per JSON value: sorted keys, no whitespace, UTF-8 as is."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sha256_of(value: Any) -> str:
    """Hex SHA-256 of ``canonical_json(value)`` in UTF-8 (what ``schema=``/``tools=`` stamp)."""
    return hashlib.sha256(canonical_json(value).encode("utf-8")).hexdigest()


@dataclass(slots=True, frozen=True)
class Structured:
    """What a chat's structured-output and tool fields ask (``structured_of``); the default
    value asks nothing. ``grammar``: the text the engine constrains the output to (None:
    free text), of ``grammar_kind``; ``param`` is the field its refusal names. ``checks``:
    where the grammar is built of the fields (tools, and a format beside them), each part
    alone as (kind, grammar, param), checked before it: the format's schema and each
    called function's parameters as JSON Schemas, so that a refusal names the right field
    and the client's own schema, never the combined grammar."""

    grammar_kind: GrammarKind | None = None
    grammar: str | None = None
    param: str = "response_format"
    schema_sha256: str | None = None
    tools_sha256: str | None = None
    tools: tuple[dict[str, Any], ...] = ()  # as given: what the chat template renders
    tool_names: tuple[str, ...] = ()
    tool_choice: str = "auto"  # "none" | "auto" | "required" | a function's name
    parallel_tool_calls: bool = True
    response_format: str = "text"  # "text" | "json_object" | "json_schema"
    instruction: str | None = None  # added to the system message (the schema, for JSON)
    checks: tuple[tuple[GrammarKind, str, str], ...] = ()

    @property
    def calls_tools(self) -> bool:
        """The output may hold tool calls (read it as such)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def calls_only(self) -> bool:
        """The output can only be tool calls (``required`` or a named function)."""
        return bool(self.tools) and self.tool_choice not in ("none", "auto")

    def prompt_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages as rendered: the format's instruction appended to the system message
        (one made first if there is none), and assistant ``tool_calls`` arguments given as
        JSON text parsed (the template writes them as the model would). The input is not
        changed; unchanged messages are the same objects."""
        out = [_parsed_arguments(m) for m in messages]
        if self.instruction is None:
            return out
        first = out[0] if out else None
        if first is not None and first.get("role") == "system":
            content = first.get("content")
            if isinstance(content, str):
                out[0] = {**first, "content": f"{content}\n\n{self.instruction}"
                          if content else self.instruction}
                return out
            if isinstance(content, list):  # text parts are joined with "\n"
                part = {"type": "text", "text": "\n" + self.instruction}
                out[0] = {**first, "content": [*content, part]}
                return out
            return out  # a malformed system message: the template refuses it
        return [{"role": "system", "content": self.instruction}, *out]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template gets as ``tools`` (None: none), whatever ``tool_choice``."""
        return list(self.tools) if self.tools else None

    def versions(self) -> dict[str, str]:
        """``{"schema": sha, "tools": sha}``, only the present ones (full hex)."""
        out: dict[str, str] = {}
        if self.schema_sha256 is not None:
            out["schema"] = self.schema_sha256
        if self.tools_sha256 is not None:
            out["tools"] = self.tools_sha256
        return out

    def header_suffix(self) -> str:
        """What ``x-sluice-resolved`` gets appended: ``; schema=…; tools=…`` (short hashes)."""
        return "".join(f"; {name}={short(sha)}" for name, sha in self.versions().items())


NO_STRUCTURE = Structured()


def structured_of(req: ChatRequest | TokenizeRequest) -> Structured:
    """Validate a chat's (or a tokenize request's) structured-output and tool fields; raises
    BadRequest naming the field. A tokenize request has no ``tool_choice``: ``auto``."""
    if isinstance(req, ChatRequest):
        _refuse_legacy(req)
        choice_value: object = req.tool_choice
        parallel = req.parallel_tool_calls is not False
    else:
        choice_value, parallel = None, True
    if req.messages is not None:
        _check_tool_messages(req.messages)
    fmt, schema, instruction = _response_format(req.response_format)
    given = req.tools or []
    tools = [_tool(i, t) for i, t in enumerate(given)]
    names = [t[0] for t in tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise BadRequest(f"tools: the function name {dup!r} is defined twice", "tools",
                         code="invalid_value")
    choice = _tool_choice(choice_value, names)
    schema_sha = None if schema is None else sha256_of(schema)
    tools_sha = sha256_of(given) if given else None
    base = Structured(schema_sha256=schema_sha, tools_sha256=tools_sha, tools=tuple(given),
                      tool_names=tuple(names), tool_choice=choice,
                      parallel_tool_calls=parallel, response_format=fmt,
                      instruction=instruction)
    if not tools or choice == "none":
        if schema is None:
            return base
        return _with(base, "json_schema", grammars.schema_text(schema), "response_format")
    wanted = tools if choice in ("auto", "required") else [t for t in tools if t[0] == choice]
    # the format's schema is checked even where the turn is calls only (required, a named
    # function): it was asked for and is stamped, so what cannot be enforced is refused
    parts: list[tuple[GrammarKind, str, str]] = [] if schema is None else [
        ("json_schema", grammars.schema_text(schema), "response_format")]
    parts += [("json_schema", grammars.parameters_text(params), "tools")
              for _, params in wanted]
    checks = tuple(dict.fromkeys(parts))  # each once (functions without parameters)
    if choice != "auto":
        grammar = grammars.calls_only(wanted, parallel)
    elif schema is None:
        grammar = grammars.text_or_calls(wanted, parallel)
    else:
        grammar = grammars.answer_or_calls(schema, wanted, parallel)
    return _with(base, "lark", grammar, "tools", checks)


def _with(base: Structured, kind: GrammarKind, grammar: str, param: str,
          checks: tuple[tuple[GrammarKind, str, str], ...] = ()) -> Structured:
    return Structured(kind, grammar, param, base.schema_sha256, base.tools_sha256, base.tools,
                      base.tool_names, base.tool_choice, base.parallel_tool_calls,
                      base.response_format, base.instruction, checks)


# ---- validation ---------------------------------------------------------------------------
def _refuse_legacy(req: ChatRequest) -> None:
    if req.functions:
        raise BadRequest("'functions' is deprecated and not supported; use 'tools'",
                         "functions", code="unsupported_parameter")
    if req.function_call is not None and req.function_call != "none":
        raise BadRequest("'function_call' is deprecated and not supported; use "
                         "'tool_choice'", "function_call", code="unsupported_parameter")


def _keys(obj: dict[str, Any], allowed: Iterable[str], where: str, param: str) -> None:
    extra = sorted(set(obj) - set(allowed))
    if extra:
        raise BadRequest(f"{where} has an unknown field {extra[0]!r}", param,
                         code="invalid_value")


def _response_format(value: dict[str, Any] | None) -> tuple[str, Any, str | None]:
    """(format, schema or None, instruction or None)."""
    if value is None:
        return "text", None, None
    kind = value.get("type")
    if kind == "text":
        _keys(value, ("type",), "response_format", "response_format")
        return "text", None, None
    if kind == "json_object":
        _keys(value, ("type",), "response_format", "response_format")
        return "json_object", dict(JSON_OBJECT_SCHEMA), _OBJECT_INSTRUCTION
    if kind != "json_schema":
        raise BadRequest(f"response_format.type must be 'text', 'json_object' or "
                         f"'json_schema', not {kind!r}", "response_format",
                         code="invalid_value")
    _keys(value, ("type", "json_schema"), "response_format", "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise BadRequest("response_format.json_schema must be an object with 'name' and "
                         "'schema'", "response_format", code="invalid_value")
    _keys(spec, ("name", "description", "schema", "strict"), "response_format.json_schema",
          "response_format")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BadRequest("response_format.json_schema.name must be 1-64 characters of "
                         "a-z, A-Z, 0-9, '_' and '-'", "response_format", code="invalid_value")
    if "description" in spec and not isinstance(spec["description"], str):
        raise BadRequest("response_format.json_schema.description must be a string",
                         "response_format", code="invalid_value")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise BadRequest("response_format.json_schema.strict must be a boolean",
                         "response_format", code="invalid_value")
    if "schema" not in spec:
        raise BadRequest("response_format.json_schema.schema is required",
                         "response_format", code="missing_required_parameter")
    schema = spec["schema"]
    if schema is False:
        raise BadRequest("response_format.json_schema.schema is false, which no JSON value "
                         "matches: no answer could follow it", "response_format",
                         code="invalid_value")
    if not isinstance(schema, (dict, bool)):
        raise BadRequest("response_format.json_schema.schema must be a JSON Schema object "
                         "(or true)", "response_format", code="invalid_value")
    text = json.dumps(schema, ensure_ascii=False)
    return "json_schema", schema, _SCHEMA_INSTRUCTION + text


def _tool(i: int, tool: object) -> tuple[str, dict[str, Any]]:
    """(name, arguments schema) of ``tools[i]``."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise BadRequest(f"{where} must be {{'type': 'function', 'function': {{...}}}}",
                         "tools", code="invalid_value")
    _keys(tool, ("type", "function"), where, "tools")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise BadRequest(f"{where}.function must be an object", "tools", code="invalid_value")
    _keys(fn, ("name", "description", "parameters", "strict"), f"{where}.function", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BadRequest(f"{where}.function.name must be 1-64 characters of a-z, A-Z, 0-9, "
                         "'_' and '-'", "tools", code="invalid_value")
    if "description" in fn and not isinstance(fn["description"], str):
        raise BadRequest(f"{where}.function.description must be a string", "tools",
                         code="invalid_value")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise BadRequest(f"{where}.function.strict must be a boolean", "tools",
                         code="invalid_value")
    params = fn.get("parameters")
    if params is None:  # OpenAI: no parameters is a function of none
        return name, {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(params, dict):
        raise BadRequest(f"{where}.function.parameters must be a JSON Schema object", "tools",
                         code="invalid_value")
    kind = params.get("type", "object")
    if kind != "object":
        raise BadRequest(f"{where}.function.parameters must describe an object (type "
                         f"'object'), not {kind!r}", "tools", code="invalid_value")
    return name, {**params, "type": "object"}


def _tool_choice(value: object, names: list[str]) -> str:
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in _CHOICES:
            raise BadRequest(f"tool_choice must be 'none', 'auto', 'required' or "
                             f"{{'type': 'function', 'function': {{'name': ...}}}}, not "
                             f"{value!r}", "tool_choice", code="invalid_value")
        if value == "required" and not names:
            raise BadRequest("tool_choice 'required' needs tools", "tool_choice",
                             code="invalid_value")
        return value
    fn = value.get("function") if isinstance(value, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" \
            or not isinstance(name, str) or set(value) != {"type", "function"} \
            or set(fn or ()) != {"name"}:
        raise BadRequest("tool_choice must be 'none', 'auto', 'required' or "
                         "{'type': 'function', 'function': {'name': ...}}", "tool_choice",
                         code="invalid_value")
    if name not in names:
        raise BadRequest(f"tool_choice names the function {name!r}, which is not in tools",
                         "tool_choice", code="invalid_value")
    return name


def _check_tool_messages(messages: list[dict[str, Any]]) -> None:
    """Assistant ``tool_calls`` are OpenAI's shape; a tool result answers one of the calls
    of the assistant message before it (other results in between), by its id."""
    answerable: set[str] | None = None  # the call ids that a tool message may answer here
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise BadRequest(f"messages[{i}] (role 'tool') needs a string 'tool_call_id'",
                                 "messages", code="invalid_value")
            if answerable is None:
                raise BadRequest(f"messages[{i}] (role 'tool') must answer a call: it does "
                                 "not follow an assistant message with 'tool_calls'",
                                 "messages", code="invalid_value")
            if call_id not in answerable:
                raise BadRequest(f"messages[{i}].tool_call_id {call_id!r} is not the id of a "
                                 "call in the assistant message before it", "messages",
                                 code="invalid_value")
        else:
            answerable = None
        calls = m.get("tool_calls")
        if calls is None:
            continue
        if role != "assistant" or not isinstance(calls, list):
            raise BadRequest(f"messages[{i}].tool_calls must be a list on an assistant "
                             "message", "messages", code="invalid_value")
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                    or not isinstance(fn.get("arguments"), (str, dict)):
                raise BadRequest(f"messages[{i}].tool_calls[{j}] must be {{'id', 'type': "
                                 "'function', 'function': {'name', 'arguments'}}",
                                 "messages", code="invalid_value")
        answerable = {c["id"] for c in calls if isinstance(c.get("id"), str)}


def _parsed_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with its tool calls' arguments parsed from JSON text where they are."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        return message
    out: list[Any] = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                parsed = json.loads(fn["arguments"])
            except (ValueError, RecursionError):
                parsed = None  # the template writes it as given
            if isinstance(parsed, dict):
                call = {**call, "function": {**fn, "arguments": parsed}}
        out.append(call)
    return {**message, "tool_calls": out}
