"""The request contract: types, unknown fields, features per upstream, extensions."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.contract import check_capabilities, parse
from gateway.errors import BadRequest
from protocol.contract import OPENAI_CAPABILITIES, SLUICE_CAPABILITIES

MSGS = [{"role": "user", "content": "hi"}]


def refused(kind: str, body: dict[str, Any], caps: frozenset[str] = SLUICE_CAPABILITIES) -> str:
    with pytest.raises(BadRequest) as info:
        check_capabilities(parse(kind, body), "m", caps)  # type: ignore[arg-type]
    assert info.value.param is not None
    return info.value.param


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": MSGS}, "model"),
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"content": "no role"}]}, "messages"),
    ({"model": "m", "messages": MSGS, "max_tokens": "10"}, "max_tokens"),  # strict types
    ({"model": "m", "messages": MSGS, "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "messages": MSGS, "temperature": 3}, "temperature"),
    ({"model": "m", "messages": MSGS, "stream": 1}, "stream"),
    ({"model": "m", "messages": MSGS, "frobnicate": True}, "frobnicate"),
    ({"model": "m", "messages": MSGS, "cache_salt": "x"}, "cache_salt"),
    ({"model": "m", "messages": MSGS, "deadline_ms": 0}, "deadline_ms"),
    ({"model": "m", "messages": MSGS, "priority": 1.5}, "priority"),
    ({"model": "m", "messages": MSGS, "stream_options": {"include_usage": True, "x": 1}},
     "stream_options"),
])
def test_invalid_chat_bodies_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse("chat", body)
    assert info.value.param == param, info.value.message


def test_batched_prompts_are_refused_but_token_ids_are_fine() -> None:
    assert parse("completion", {"model": "m", "prompt": [1, 2, 3]})
    with pytest.raises(BadRequest) as info:
        parse("completion", {"model": "m", "prompt": ["a", "b"]})
    assert info.value.param == "prompt"


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     "response_format"),
])
def test_the_bundled_backend_serves_tools_and_response_format(body: dict[str, Any],
                                                              param: str) -> None:
    """Issue #24: forwarded to a ``kind: sluice`` upstream (constrained decoding in its
    engine); a server configured without the capability still refuses them, naming the
    field."""
    full = {"model": "m", "messages": MSGS, **body}
    check_capabilities(parse("chat", full), "m", SLUICE_CAPABILITIES)
    check_capabilities(parse("chat", full), "m", OPENAI_CAPABILITIES)
    assert refused("chat", full, frozenset({"n"})) == param


def test_continuous_usage_is_the_bundled_backends_not_a_plain_openai_servers() -> None:
    full = {"model": "m", "messages": MSGS, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    check_capabilities(parse("chat", full), "m", SLUICE_CAPABILITIES)
    assert refused("chat", full, OPENAI_CAPABILITIES) == "stream_options"


def test_the_bundled_backend_serves_n() -> None:
    """The gateway forwards ``n`` to a ``kind: sluice`` upstream (issue #21: forked choices)."""
    check_capabilities(parse("chat", {"model": "m", "messages": MSGS, "n": 4}), "m",
                       SLUICE_CAPABILITIES)
    check_capabilities(parse("completion", {"model": "m", "prompt": "x", "n": 128}), "m",
                       SLUICE_CAPABILITIES)


def test_the_bundled_backend_serves_logprobs_bias_and_penalties() -> None:
    """The gateway forwards them to a ``kind: sluice`` upstream (issue #21)."""
    for body in ({"logprobs": True, "top_logprobs": 3}, {"presence_penalty": 0.5},
                 {"frequency_penalty": -0.5}, {"logit_bias": {"1": 2}}):
        check_capabilities(parse("chat", {"model": "m", "messages": MSGS, **body}), "m",
                           SLUICE_CAPABILITIES)


def test_default_values_of_missing_features_pass() -> None:
    body = {"model": "m", "messages": MSGS, "n": 1, "logprobs": False, "presence_penalty": 0,
            "response_format": {"type": "text"}, "tool_choice": "none", "top_k": -1}
    check_capabilities(parse("chat", body), "m", SLUICE_CAPABILITIES)


def test_stream_options_need_streaming() -> None:
    assert refused("chat", {"model": "m", "messages": MSGS,
                            "stream_options": {"include_usage": True}}) == "stream_options"


def test_completion_only_features() -> None:
    assert refused("completion", {"model": "m", "prompt": "x", "echo": True}) == "echo"
    assert refused("completion", {"model": "m", "prompt": "x", "best_of": 3}) == "best_of"
    with pytest.raises(BadRequest) as info:
        parse("completion", {"model": "m", "prompt": "x", "messages": MSGS})
    assert info.value.param == "messages"


def test_the_gateway_serves_priority_and_deadlines_for_any_upstream() -> None:
    body = {"model": "m", "messages": MSGS, "priority": 3, "deadline_ms": 500}
    check_capabilities(parse("chat", body), "m", OPENAI_CAPABILITIES)
    check_capabilities(parse("chat", body), "m", frozenset())


def test_the_backend_and_the_gateway_differ_only_on_model_and_cache_salt() -> None:
    from protocol.contract import parse as parse_fields

    assert parse_fields("chat", {"messages": MSGS, "cache_salt": "s"}).cache_salt == "s"
    for body, param in (({"messages": MSGS}, "model"),
                        ({"model": "m", "messages": MSGS, "cache_salt": "s"}, "cache_salt")):
        with pytest.raises(BadRequest) as info:
            parse("chat", body)
        assert info.value.param == param
