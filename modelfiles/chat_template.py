"""The chat template: where a checkpoint keeps it, and how it is rendered, as in transformers.

* The template comes from `chat_template.jinja` if present, else from
  `tokenizer_config.json` (`chat_template` as a string, or a list of `{name, template}`); extra
  named templates may live in `chat_templates/*.jinja`. A named set uses `"default"`, or
  `"tool_use"` when tools are passed (`Tokenizer.apply_chat_template`).
* Rendering uses HF's sandboxed jinja environment (`build_environment`), over plain JSON copies
  of the messages (`normalize_messages`), so a template never sees a caller's objects.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import InvalidMessagesError, ModelLoadError

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "chat_templates"

# Names a message's reasoning is passed under; HF copies it under the first and "thinking".
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def build_environment() -> ImmutableSandboxedEnvironment:
    """The jinja environment HF renders chat templates with (chat_template_utils.py)."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # HF overrides jinja's tojson, which would HTML-escape the output.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    class TemplateDict:
        """`dict` without attribute access to the type itself (no type-hackery escapes)."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """`namespace()` that refuses underscore-prefixed attributes."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: object) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes, got {name!r}"
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


def plain_copy(value: Any) -> Any:
    """A copy made only of JSON types, so the sandbox never sees caller objects (as HF does)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_copy(k): plain_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_copy(v) for v in value)
    return f"<{type(value).__name__}>"


def normalize_messages(messages: object) -> list[dict[str, Any]]:
    """Validate OpenAI-style chat messages and return plain copies ready for a template.

    Each message is a dict with a string `role` and a `content` that is a string or a list of
    `{"type": "text", "text": ...}` parts (joined with "\\n", as vLLM does). An assistant message
    may omit content when it carries `tool_calls`. Keys whose value is None are dropped, as HF
    does. Raises InvalidMessagesError(param="messages").
    """
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise InvalidMessagesError("messages must be a list of message objects", param="messages")
    if not messages:
        raise InvalidMessagesError("messages must not be empty", param="messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidMessagesError(f"messages[{i}] must be an object", param="messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidMessagesError(f"messages[{i}].role must be a string", param="messages")
        plain = {k: v for k, v in plain_copy(dict(message)).items() if v is not None}
        content = plain.get("content")
        if isinstance(content, list):
            plain["content"] = _join_text_parts(content, i)
        elif content is None:
            if not (role == "assistant" and plain.get("tool_calls")):
                raise InvalidMessagesError(f"messages[{i}].content is required", param="messages")
        elif not isinstance(content, str):
            raise InvalidMessagesError(
                f"messages[{i}].content must be a string or a list of text parts", param="messages"
            )
        reasoning = next((plain[k] for k in _REASONING_FIELDS if plain.get(k) is not None), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        out.append(plain)
    return out


def _join_text_parts(parts: list[Any], index: int) -> str:
    texts: list[str] = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise InvalidMessagesError(
                f"messages[{index}].content[{j}] must be a text part; only text is supported",
                param="messages",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidMessagesError(
                f"messages[{index}].content[{j}].text must be a string", param="messages"
            )
        texts.append(text)
    return "\n".join(texts)


def load_chat_template(root: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """chat_template.jinja (and chat_templates/*.jinja) win over tokenizer_config's template."""
    files: dict[str, str] = {}
    if (root / CHAT_TEMPLATE_FILE).is_file():
        files["default"] = (root / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (root / CHAT_TEMPLATE_DIR).is_dir():
        for path in sorted((root / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if files:
        return files["default"] if list(files) == ["default"] else files

    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        try:
            return {str(t["name"]): str(t["template"]) for t in value}
        except (KeyError, TypeError) as exc:
            raise ModelLoadError(
                f"{TOKENIZER_CONFIG_FILE}: chat_template list items need 'name' and 'template'"
            ) from exc
    raise ModelLoadError(f"{TOKENIZER_CONFIG_FILE}: chat_template must be a string or a list")
