"""The request contract: OpenAI chat and completion bodies plus Sluice's extensions.

Every field is typed; an unknown field is refused with a 400 naming it (as OpenAI does), so
nothing a client sends is silently dropped. Optional features (tools, logprobs, penalties, …)
are checked against what the model's upstream implements: a non-default value that the
upstream cannot honor is refused, never forwarded to be ignored.

Extensions: ``priority`` (lower is more urgent), ``deadline_ms`` (or the header
``x-sluice-deadline-ms``), the version pin ``model: "name@revision"``. ``cache_salt`` is
derived by the gateway per tenant; a client may not choose it.
"""

from __future__ import annotations

from typing import Any, Literal

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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: StrictStr = Field(min_length=1)
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, ge=0, le=1)
    n: StrictInt | None = Field(None, ge=1, le=128)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    user: StrictStr | None = None
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    logit_bias: dict[StrictStr, Number] | None = None
    # vLLM's sampling extensions
    top_k: StrictInt | None = None
    min_p: Number | None = Field(None, ge=0, le=1)
    repetition_penalty: Number | None = Field(None, gt=0)
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[StrictInt] | None = None
    min_tokens: StrictInt | None = Field(None, ge=0)
    service_tier: StrictStr | None = None
    store: StrictBool | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    # Sluice's extensions
    priority: StrictInt | None = None
    deadline_ms: StrictInt | None = Field(None, ge=1)
    cache_salt: Any = None  # refused below: the gateway derives it per tenant


class ChatRequest(_Common):
    messages: list[dict[StrictStr, Any]] = Field(min_length=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    tools: list[dict[StrictStr, Any]] | None = None
    tool_choice: StrictStr | dict[StrictStr, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    functions: list[dict[StrictStr, Any]] | None = None
    function_call: StrictStr | dict[StrictStr, Any] | None = None
    response_format: dict[StrictStr, Any] | None = None
    reasoning_effort: StrictStr | None = None


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool | None = None
    suffix: StrictStr | None = None
    best_of: StrictInt | None = Field(None, ge=1)


def _truthy(v: Any) -> bool:
    return bool(v)


def _set(v: Any) -> bool:
    return v is not None


# field -> (capability it needs, "the value uses it")
_USES: dict[str, tuple[str, Any]] = {
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
}


def _validation_error(exc: ValidationError) -> BadRequest:
    err = exc.errors(include_url=False)[0]
    loc = err.get("loc", ())
    param = str(loc[0]) if loc else None
    where = ".".join(str(p) for p in loc)
    kind = err.get("type")
    if kind == "extra_forbidden":
        return BadRequest(f"unrecognized request argument supplied: {where}", param,
                          code="unknown_parameter")
    if kind == "missing":
        return BadRequest(f"missing required parameter: {where!r}", param,
                          code="missing_required_parameter")
    return BadRequest(f"invalid value for {where!r}: {err.get('msg', 'invalid value')}", param,
                      code="invalid_value")


def parse(kind: Kind, body: dict[str, Any]) -> ChatRequest | CompletionRequest:
    """Validate a body's types and ranges; raises BadRequest naming the field."""
    try:
        if kind == "chat":
            req: ChatRequest | CompletionRequest = ChatRequest.model_validate(body)
        else:
            req = CompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    if req.cache_salt is not None:
        raise BadRequest("cache_salt is chosen by the gateway for each tenant; do not send it",
                         "cache_salt", code="unsupported_parameter")
    if isinstance(req, ChatRequest):
        for i, message in enumerate(req.messages):
            if not isinstance(message.get("role"), str):
                raise BadRequest(f"messages[{i}] needs a string 'role'", "messages",
                                 code="invalid_value")
    elif isinstance(req.prompt, list):
        if not req.prompt:
            raise BadRequest("prompt may not be empty", "prompt", code="invalid_value")
        if len(req.prompt) > 1 and not isinstance(req.prompt[0], int):
            raise BadRequest("batched prompts are not supported: send one prompt per request",
                             "prompt", code="unsupported_parameter")
    return req


def check_capabilities(req: ChatRequest | CompletionRequest, model: str,
                       capabilities: frozenset[str]) -> None:
    """Refuse a feature the model's upstream cannot honor (400 naming the field)."""
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
    if opts is not None and not req.stream:
        raise BadRequest("stream_options is only allowed with stream: true", "stream_options",
                         code="invalid_value")
