"""The field policy both servers apply: known fields typed, features served or refused."""

from __future__ import annotations

from typing import Any

import pytest

from protocol.contract import (
    CAPABILITIES,
    MAX_MESSAGES,
    MAX_PROMPT_VALUES,
    OPENAI_CAPABILITIES,
    SLUICE_CAPABILITIES,
    ChatRequest,
    CompletionRequest,
    check_capabilities,
    check_render_size,
    parse,
    parse_tokenize,
)
from protocol.errors import BadRequest

MSGS = [{"role": "user", "content": "hi"}]


def refusal(kind: str, body: dict[str, Any], caps: frozenset[str]) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        check_capabilities(parse(kind, body), "m", caps)  # type: ignore[arg-type]
    return info.value


def test_capability_sets_use_known_names() -> None:
    assert SLUICE_CAPABILITIES <= CAPABILITIES and OPENAI_CAPABILITIES <= CAPABILITIES


@pytest.mark.parametrize(("field", "value", "code"), [
    ("frobnicate", 1, "unknown_parameter"),
    ("max_tokens", "10", "invalid_value"),
    ("max_tokens", 0, "invalid_value"),
    ("temperature", 2.5, "invalid_value"),
    ("stream", 1, "invalid_value"),
    ("cache_salt", 7, "invalid_value"),
    ("model", "", "invalid_value"),
])
def test_bad_fields_are_named(field: str, value: Any, code: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse("chat", {"messages": MSGS, field: value})
    assert (info.value.param, info.value.code) == (field, code)


def test_model_is_optional_here_and_the_body_must_be_an_object() -> None:
    assert parse("chat", {"messages": MSGS}).model is None
    with pytest.raises(BadRequest) as info:
        parse("completion", {"model": "m"})
    assert (info.value.param, info.value.code) == ("prompt", "missing_required_parameter")


# What the bundled backend serves and refuses, by the same rule the gateway applies.
@pytest.mark.parametrize(("body", "param"), [
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # needs stream: true
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"min_tokens": 2}, "min_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),  # served, but only with logprobs: true
    # tools, tool_choice, parallel_tool_calls and response_format are served (their values
    # are checked by protocol.structured, legacy functions refused there: test_structured.py)
    ({"repetition_penalty": 1.1}, "repetition_penalty"),
    ({"metadata": {"k": "v"}}, "metadata"),
])
def test_the_backend_refuses_what_its_engine_does_not_serve(body: dict[str, Any],
                                                            param: str) -> None:
    err = refusal("chat", {"messages": MSGS, **body}, SLUICE_CAPABILITIES)
    assert err.param == param and err.status == 400


@pytest.mark.parametrize(("body", "param"), [
    ({"echo": True}, "echo"), ({"suffix": "s"}, "suffix"), ({"best_of": 2}, "best_of"),
    ({"logprobs": 21}, "logprobs"),  # served, 0-20 as vLLM
])
def test_completion_features(body: dict[str, Any], param: str) -> None:
    assert refusal("completion", {"prompt": "x", **body}, SLUICE_CAPABILITIES).param == param


def test_what_the_backend_serves_passes() -> None:
    body = {"messages": MSGS, "seed": 1, "stop": ["x"], "top_k": 5, "stop_token_ids": [1],
            "ignore_eos": True, "user": "u", "priority": -3, "cache_salt": "s",
            "deadline_ms": 100, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            # defaults ask for nothing
            "n": 1, "logprobs": False, "presence_penalty": 0, "tool_choice": "none",
            "response_format": {"type": "text"}}
    req = parse("chat", body)
    check_capabilities(req, "m", SLUICE_CAPABILITIES)
    assert req.include_usage and req.continuous_usage
    served = {"messages": MSGS, "logprobs": True, "top_logprobs": 20, "presence_penalty": 2,
              "frequency_penalty": -2, "logit_bias": {"0": -100, "31999": 100}}
    check_capabilities(parse("chat", served), "m", SLUICE_CAPABILITIES)
    check_capabilities(parse("completion", {"prompt": "x", "logprobs": 5}), "m",
                       SLUICE_CAPABILITIES)


@pytest.mark.parametrize("bias", [{"01": 1}, {"-1": 1}, {"a": 1}, {"1": 100.5},
                                  {"1": -101}, {"": 0}])
def test_logit_bias_is_token_ids_to_bounded_biases(bias: dict[str, float]) -> None:
    with pytest.raises(BadRequest) as info:
        parse("chat", {"messages": MSGS, "logit_bias": bias})
    assert (info.value.param, info.value.code) == ("logit_bias", "invalid_value")


def test_the_sluice_extensions_are_capabilities() -> None:
    body = {"messages": MSGS, "priority": 1}
    assert refusal("chat", body, OPENAI_CAPABILITIES).param == "priority"
    body = {"messages": MSGS, "cache_salt": "s"}
    assert refusal("chat", body, OPENAI_CAPABILITIES).param == "cache_salt"
    check_capabilities(parse("chat", {"messages": MSGS, "deadline_ms": 5}), "m", frozenset())


def test_prompts() -> None:
    req = parse("completion", {"prompt": [1, 2, 3]})
    assert isinstance(req, CompletionRequest) and req.prompt == [1, 2, 3]
    for prompt, code in (([], "invalid_value"), (["a", "b"], "unsupported_parameter")):
        with pytest.raises(BadRequest) as info:
            parse("completion", {"prompt": prompt})
        assert (info.value.param, info.value.code) == ("prompt", code)
    with pytest.raises(BadRequest) as info:
        parse("chat", {"messages": [{"content": "no role"}]})
    assert info.value.param == "messages"


def test_the_number_of_messages_is_capped_before_anything_walks_them() -> None:
    at_cap = [{"role": "user", "content": ""}] * MAX_MESSAGES
    req = parse("chat", {"messages": at_cap})
    assert isinstance(req, ChatRequest) and len(req.messages) == MAX_MESSAGES
    # past the cap: 400 naming messages, before pydantic looks at any of them (an element
    # that would fail validation is never reached)
    over = [*at_cap, "not even a message"]
    for check in (lambda: parse("chat", {"messages": over}),
                  lambda: parse_tokenize({"messages": over})):
        with pytest.raises(BadRequest) as info:
            check()
        err = info.value
        assert (err.status, err.param, err.code) == (400, "messages", "invalid_value")
        assert f"at most {MAX_MESSAGES}" in err.message and str(MAX_MESSAGES + 1) in err.message


def test_what_a_template_renders_is_capped_in_json_values() -> None:
    # 1 (the message list) + 3 members + the extra list's elements: exactly at the cap
    at_cap = [{"role": "user", "content": "x", "extra": [0] * (MAX_PROMPT_VALUES - 4)}]
    check_render_size(at_cap)
    tools = [{"type": "function"}]  # 2 more values
    for messages, extra in ((at_cap, tools),
                            ([{"role": "user", "content": [{"type": "text"}] * 70_000}], None)):
        with pytest.raises(BadRequest) as info:
            check_render_size(messages, extra)
        err = info.value
        assert (err.status, err.param) == (400, "messages") and str(MAX_PROMPT_VALUES) in err.message


def test_opting_out_of_speculation_is_a_capability() -> None:
    """``speculative: false`` goes to a server that speculates (the bundled one) and is
    refused, naming the field, by one that cannot be told; ``true`` asks for nothing."""

    def req(value: bool) -> ChatRequest:
        return ChatRequest.model_validate({"model": "m", "speculative": value,
                                           "messages": [{"role": "user", "content": "x"}]})

    check_capabilities(req(False), "m", SLUICE_CAPABILITIES)
    check_capabilities(req(True), "m", OPENAI_CAPABILITIES)
    with pytest.raises(BadRequest) as refused:
        check_capabilities(req(False), "m", OPENAI_CAPABILITIES)
    assert refused.value.param == "speculative"
