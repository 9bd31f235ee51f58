"""The request contract: OpenAI chat and completion bodies plus Sluice's extensions.

One field policy on both sides of the wire: every field is typed, and a field is either
served or refused with a 400 naming it, never silently dropped.

- A field no model knows is refused by ``parse`` (``unknown_parameter``), as OpenAI does.
- A known feature (tools, logprobs, penalties, …) whose value asks for something is checked
  by ``check_capabilities`` against what the server in question implements: the gateway
  checks against each upstream's ``capabilities``, the bundled backend against
  ``SLUICE_CAPABILITIES``, what its engine serves (``unsupported_parameter``).

Extensions: ``priority`` (lower is more urgent), ``deadline_ms`` (the client gives up after
it; the gateway sheds on it), the version pin ``model: "name@revision"``, and ``cache_salt``
(the prefix-cache partition: the gateway derives it per tenant and refuses it from clients,
the backend takes it from the gateway), and ``speculative: false`` (this request opts out
of speculative decoding; ``true`` is the default and asks for nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)

from .errors import BadRequest

Kind = Literal["chat", "completion"]
Number = float  # strict mode still accepts an int for a float field
# Every integer of a request fits an int64, what the engine (torch, its process wire) holds:
# a priority of 10**400 stopped the engine's step loop. Fields narrow it further.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]
# At most this many chat messages per request, or a 400 naming ``messages``, checked before
# anything walks them. Rendering a chat template is pure Python, 3-13 µs a message (the
# bundled template; a tool-calling one): at the cap 6-27 ms of a tokenize worker, where a
# 4 MiB body of 120,000 empty messages took seconds. docs/gateway.md#limits-on-malformed-input.
MAX_MESSAGES = 2048
# At most this many JSON values (array elements and object members, at any depth) in a
# chat's messages and tools together, or a 400 naming ``messages``. The chat template copies
# and walks them in pure Python (0.1-1.5 µs each): within this a render stays under ~40 ms,
# where one message of 130,000 text parts, or 1.3M numbers in an extra key, took 125-180 ms
# under the message cap. Checked in the tokenize worker, before rendering.
MAX_PROMPT_VALUES = 65_536
# logit_bias: token ids as canonical decimal strings (no sign, no leading zero: one spelling
# per token) mapped to a bias in [-100, 100], as OpenAI.
TokenIdKey = Annotated[StrictStr, Field(pattern=r"^(0|[1-9][0-9]{0,9})$")]
Bias = Annotated[Number, Field(ge=-100, le=100)]

# Every capability a server may have (the names an upstream's ``supports:`` list may use).
CAPABILITIES = frozenset({
    "n", "tools", "response_format", "logprobs", "logit_bias", "penalties", "top_k", "min_p",
    "repetition_penalty", "ignore_eos", "stop_token_ids", "min_tokens", "best_of", "echo",
    "suffix", "priority", "cache_salt", "continuous_usage_stats", "reasoning_effort",
    "service_tier", "store", "metadata", "seed", "stop", "user", "speculative",
})
# What the bundled backend's engine serves; the backend refuses the rest.
SLUICE_CAPABILITIES = frozenset({
    "top_k", "min_p", "ignore_eos", "stop_token_ids", "priority", "cache_salt",
    "continuous_usage_stats",
    "seed", "stop", "user", "n", "logprobs", "logit_bias", "penalties", "speculative",
    "tools", "response_format",
})
# What a generic OpenAI-compatible server is assumed to serve unless configured otherwise.
OPENAI_CAPABILITIES = frozenset({
    "n", "tools", "response_format", "logprobs", "logit_bias", "penalties", "seed", "stop",
    "user",
})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: StrictBool | None = None
    # vLLM's extension: usage (running counts) on every chunk, when include_usage is set
    continuous_usage_stats: StrictBool | None = None


class GenerationRequest(BaseModel):
    """What chat and completion bodies share."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: StrictStr | None = Field(None, min_length=1)  # the gateway requires it
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, ge=0, le=1)
    n: Int | None = Field(None, ge=1, le=128)
    stop: StrictStr | list[StrictStr] | None = None
    seed: Int | None = None
    user: StrictStr | None = None
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    logit_bias: dict[TokenIdKey, Bias] | None = None
    # vLLM's sampling extensions
    top_k: Int | None = None
    min_p: Number | None = Field(None, ge=0, le=1)
    repetition_penalty: Number | None = Field(None, gt=0)
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[Int] | None = None
    min_tokens: Int | None = Field(None, ge=0)
    service_tier: StrictStr | None = None
    store: StrictBool | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    # Sluice's extensions
    priority: Int | None = None
    deadline_ms: Int | None = Field(None, ge=1)
    cache_salt: StrictStr | None = None
    speculative: StrictBool | None = None  # false: no speculative decoding for this one

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Running usage on every chunk: asked, and usage asked for at all."""
        return self.include_usage and bool(self.stream_options
                                           and self.stream_options.continuous_usage_stats)


class ChatRequest(GenerationRequest):
    messages: list[dict[StrictStr, Any]] = Field(min_length=1)
    logprobs: StrictBool | None = None
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    tools: list[dict[StrictStr, Any]] | None = None
    tool_choice: StrictStr | dict[StrictStr, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    functions: list[dict[StrictStr, Any]] | None = None
    function_call: StrictStr | dict[StrictStr, Any] | None = None
    response_format: dict[StrictStr, Any] | None = None
    reasoning_effort: StrictStr | None = None


class CompletionRequest(GenerationRequest):
    prompt: StrictStr | list[Int] | list[StrictStr] | list[list[Int]]
    logprobs: Int | None = Field(None, ge=0, le=20)  # top logprobs per token (vLLM: <= 20)
    echo: StrictBool | None = None
    suffix: StrictStr | None = None
    best_of: Int | None = Field(None, ge=1)


Request = ChatRequest | CompletionRequest
R = TypeVar("R", bound=GenerationRequest)


def _truthy(v: Any) -> bool:
    return bool(v)


def _set(v: Any) -> bool:
    return v is not None


# field -> (capability it needs, "the value asks for it"); defaults ask for nothing
_USES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "n": ("n", lambda v: v is not None and v != 1),
    "tools": ("tools", _truthy),
    "functions": ("tools", _truthy),
    "tool_choice": ("tools", lambda v: v is not None and v != "none"),
    "function_call": ("tools", lambda v: v is not None and v != "none"),
    "parallel_tool_calls": ("tools", _set),
    "response_format": ("response_format",
                        lambda v: v is not None and v.get("type", "text") != "text"),
    "logprobs": ("logprobs", _truthy),
    "top_logprobs": ("logprobs", _truthy),
    "logit_bias": ("logit_bias", _truthy),
    "presence_penalty": ("penalties", _truthy),
    "frequency_penalty": ("penalties", _truthy),
    "top_k": ("top_k", lambda v: v is not None and v not in (0, -1)),
    "min_p": ("min_p", _truthy),
    "repetition_penalty": ("repetition_penalty", lambda v: v is not None and v != 1),
    "ignore_eos": ("ignore_eos", _truthy),
    "stop_token_ids": ("stop_token_ids", _truthy),
    "min_tokens": ("min_tokens", _truthy),
    "best_of": ("best_of", lambda v: v is not None and v != 1),
    "echo": ("echo", _truthy),
    "suffix": ("suffix", _truthy),
    "reasoning_effort": ("reasoning_effort", _set),
    "service_tier": ("service_tier", _set),
    "store": ("store", _truthy),
    "metadata": ("metadata", _truthy),
    "seed": ("seed", _set),
    "stop": ("stop", _truthy),
    "user": ("user", _set),
    "priority": ("priority", _set),
    "cache_salt": ("cache_salt", _set),
    "speculative": ("speculative", lambda v: v is False),  # only opting out asks anything
}


def validation_error(exc: ValidationError) -> BadRequest:
    """The first pydantic error as a 400 naming the field."""
    err = exc.errors(include_url=False)[0]
    loc = err.get("loc", ())
    param = str(loc[0]) if loc else None
    where = ".".join(str(p) for p in loc)
    kind = err.get("type")
    msg = err.get("msg", "invalid value")
    if kind == "extra_forbidden":
        return BadRequest(f"unrecognized request argument supplied: {where}", param,
                          code="unknown_parameter")
    if kind == "missing":
        return BadRequest(f"missing required parameter: {where!r}", param,
                          code="missing_required_parameter")
    if not loc:
        return BadRequest(f"the body must be a JSON object: {msg}", code="invalid_json")
    return BadRequest(f"invalid value for {where!r}: {msg}", param, code="invalid_value")


def parse(kind: Kind, body: dict[str, Any]) -> Request:
    """Validate a body's fields, types and ranges; raises BadRequest naming the field."""
    if kind == "chat":
        return validate(ChatRequest, body)
    return validate(CompletionRequest, body)


def validate(model: type[R], body: dict[str, Any]) -> R:
    """``parse`` with a model of one's own (a subclass with a field made stricter)."""
    check_message_count(body)
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    if isinstance(req, ChatRequest):
        for i, message in enumerate(req.messages):
            if not isinstance(message.get("role"), str):
                raise BadRequest(f"messages[{i}] needs a string 'role'", "messages",
                                 code="invalid_value")
    elif isinstance(req, CompletionRequest) and isinstance(req.prompt, list):
        if not req.prompt:
            raise BadRequest("prompt may not be empty", "prompt", code="invalid_value")
        if len(req.prompt) > 1 and not isinstance(req.prompt[0], int):
            raise BadRequest("batched prompts are not supported: send one prompt per request",
                             "prompt", code="unsupported_parameter")
    return req


def check_message_count(body: dict[str, Any]) -> None:
    """At most ``MAX_MESSAGES`` messages (O(1): before pydantic walks them all)."""
    messages = body.get("messages")
    if type(messages) is list and len(messages) > MAX_MESSAGES:
        raise BadRequest(f"'messages' has {len(messages)} messages; at most {MAX_MESSAGES} "
                         "are allowed per request", "messages", code="invalid_value")


def check_render_size(messages: Any, tools: Any = None) -> None:
    """At most ``MAX_PROMPT_VALUES`` JSON values in what a chat template renders; counted
    with exact-type checks, stopping as soon as it is over (for the worker, before the
    render: ~6 ms at worst)."""
    total = 0
    stack = [messages, tools]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is not dict and kind is not list:
            continue
        total += len(item)
        if total > MAX_PROMPT_VALUES:
            raise BadRequest(f"the messages and tools hold more than {MAX_PROMPT_VALUES} "
                             "JSON values (array elements and object members); send fewer",
                             "messages", code="invalid_value")
        stack.extend(item.values() if kind is dict else item)


def check_capabilities(req: Request, model: str, capabilities: frozenset[str]) -> None:
    """Refuse a feature that the server with these capabilities cannot honor (a 400 naming
    the field); ``model`` names it in the message."""
    for name in req.model_fields_set:
        rule = _USES.get(name)
        if rule is None:
            continue
        capability, uses = rule
        if capability not in capabilities and uses(getattr(req, name)):
            raise BadRequest(f"the model {model!r} does not support {name!r}", name,
                             code="unsupported_parameter")
    opts = req.stream_options
    if opts is not None and opts.continuous_usage_stats \
            and "continuous_usage_stats" not in capabilities:
        raise BadRequest(f"the model {model!r} does not support "
                         "'stream_options.continuous_usage_stats'", "stream_options",
                         code="unsupported_parameter")
    if isinstance(req, ChatRequest) and req.top_logprobs and not req.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs",
                         code="invalid_value")
    if opts is not None and not req.stream:
        raise BadRequest("stream_options is only allowed with stream: true", "stream_options",
                         code="invalid_value")


class TokenizeRequest(BaseModel):
    """``POST /v1/tokenize`` (the bundled backend's; the gateway counts prompts with it)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: StrictStr | None = None
    prompt: StrictStr | list[Int] | None = None
    messages: list[dict[StrictStr, Any]] | None = None
    # rendered as a chat would be: the tools by the chat template, a schema's instruction
    tools: list[dict[StrictStr, Any]] | None = None
    response_format: dict[StrictStr, Any] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool | None = True


def parse_tokenize(body: dict[str, Any]) -> TokenizeRequest:
    """Validate a tokenize body: exactly one of ``prompt`` and ``messages``."""
    check_message_count(body)
    try:
        req = TokenizeRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    if (req.prompt is None) == (req.messages is None):
        raise BadRequest("give exactly one of 'prompt' or 'messages'", "prompt",
                         code="invalid_value")
    return req
