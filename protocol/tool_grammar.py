"""The grammars of tool calls and of a ``response_format`` answer beside them, as text: Lark
in llguidance's dialect, where ``%json{...}`` embeds a JSON Schema (``protocol.structured``
chooses among them; the engine compiles them).

    calls_only       "<tool_call>" call_rest more*            required, a named function
    text_or_calls    TEXT | head call_rest more*              auto
    answer_or_calls  answer | "<tool_call>" call_rest more*   auto, beside a JSON format

``more*`` only where parallel calls are allowed: without it the grammar is complete after
one call, and the engine stops there. TEXT is any non-empty text that never holds the
opening tag, and ``head`` (lazy) any text up to the first one: under ``auto`` a turn that
holds a call is always constrained. Each function's call is its own ``%json`` (name first,
a const; then its parameters' schema, local ``$ref``s rebased to where it is embedded),
llguidance's lexeme classes merge them as an ``anyOf``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .tool_calls import CALL_CLOSE, CALL_OPEN

Tools = list[tuple[str, dict[str, Any]]]  # (name, parameters' schema)

JSON_SEPARATORS = (", ", ": ")  # what a tool call's JSON has between items, after keys
# llguidance's options for a tool call's %json: those separators, no other whitespace;
# lenient: what it cannot enforce is a warning (the engine refuses it, naming it)
_CALL_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                 "lenient": True}
# ... and for a response_format answer beside tools: as the engine compiles a schema alone
_ANSWER_OPTIONS = {"whitespace_flexible": False}
# Keywords whose values are data, not schemas: a "$ref" inside them is not a reference.
_DATA_KEYS = frozenset({"const", "enum", "default", "examples"})
# Keywords whose values map names to schemas: a name there ("default", "$ref") is no keyword.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                          "dependentSchemas", "dependencies"})
_OPEN = re.escape(CALL_OPEN)


def schema_text(schema: dict[str, Any] | bool) -> str:
    """A response_format schema as the engine's ``json_schema`` grammar (order kept: the
    properties are generated in the schema's order). ``true`` is ``{}``: llguidance applies
    its options to an object only. (``false`` never comes here: ``structured_of`` refuses
    it, as no answer can match it.)"""
    return json.dumps({} if schema is True else schema)


def parameters_text(params: dict[str, Any]) -> str:
    """A function's parameters' schema alone as a ``json_schema`` grammar: what the engine
    checks first, so that a refusal names a pointer of the client's own schema and quotes no
    grammar. Its own ``x-guidance`` is dropped: embedded (``_calls``), it is not at the root,
    where llguidance reads options, so it means nothing there either."""
    return json.dumps({k: v for k, v in params.items() if k != "x-guidance"})


def calls_only(tools: Tools, parallel: bool) -> str:
    return f'start: "{_lark(CALL_OPEN)}" {_calls(tools, parallel)}'


def text_or_calls(tools: Tools, parallel: bool) -> str:
    return (f"start: TEXT | head {_calls(tools, parallel)}"
            f"head[lazy]: /(?s:.*){_OPEN}/\n"
            f"TEXT: /(?s:.+)/ & ~/(?s:.*){_OPEN}(?s:.*)/\n")


def answer_or_calls(schema: Any, tools: Tools, parallel: bool) -> str:
    return (f'start: answer | "{_lark(CALL_OPEN)}" {_calls(tools, parallel)}'
            f"answer: %json {json.dumps(_answer_schema(schema))}\n")


def _lark(text: str) -> str:
    """``text`` inside a Lark string literal."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _calls(tools: Tools, parallel: bool) -> str:
    """Lark rules for what follows the first call's opening tag: ``call_rest`` (the rest of
    that call), then more calls when ``parallel``; the first line continues a ``start``."""
    lines = ["call_rest more*" if parallel else "call_rest",
             f'call_rest: "\\n" body "\\n{_lark(CALL_CLOSE)}"',
             f'more: "\\n{_lark(CALL_OPEN)}" call_rest',
             "body: " + " | ".join(f"fn_{i}" for i in range(len(tools)))]
    for i, (name, params) in enumerate(tools):
        wrapper = {"x-guidance": _CALL_OPTIONS, "type": "object",
                   "properties": {"name": {"const": name},
                                  "arguments": _rebased(params, "#/properties/arguments")},
                   "required": ["name", "arguments"], "additionalProperties": False}
        lines.append(f"fn_{i}: %json {json.dumps(wrapper)}")
    return "\n".join(lines) + "\n"


def _answer_schema(schema: dict[str, Any] | bool) -> dict[str, Any]:
    """A response_format schema as ``%json`` embeds it: at the root (its ``$ref``s hold),
    with the engine's options for a schema alone, its own after them, lenient forced."""
    if not isinstance(schema, dict):
        return {"x-guidance": {**_ANSWER_OPTIONS, "lenient": True}}
    own = schema.get("x-guidance")
    options = {**_ANSWER_OPTIONS, **(own if isinstance(own, dict) else {}), "lenient": True}
    return {**schema, "x-guidance": options}


def _rebased(schema: Any, root: str) -> Any:
    """``schema`` with its local references (``#…``) made relative to ``root``: it is
    embedded there, so ``#/$defs/X`` becomes ``root/$defs/X``.

    Keys are keywords only in a schema: the data keywords' values (``const``, ``default``,
    …) are kept as they are, and in a name→schema map (``properties``, ``$defs``, …) every
    value is a schema whatever its name, so a property named ``default`` is rebased."""
    if isinstance(schema, list):
        return [_rebased(v, root) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = root + value[1:]
        elif key in _DATA_KEYS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebased(sub, root) for name, sub in value.items()}
        else:
            out[key] = _rebased(value, root)
    return out
