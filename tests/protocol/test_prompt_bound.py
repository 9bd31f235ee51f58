"""The lower bound on a prompt's tokens: what it measures, when it answers, its wire form."""

from __future__ import annotations

from typing import Any

from protocol.prompt_bound import LOOP_NODES, PromptBound, prompt_texts

BOUND = PromptBound(max_token_bytes=10)


def test_it_answers_only_when_the_text_alone_exceeds_the_limit() -> None:
    assert BOUND.over("completion", "x" * 1000, 99) == 100
    assert BOUND.over("completion", "x" * 1000, 100) is None  # 100 tokens may fit in 100
    assert BOUND.over("completion", ["x" * 1001], 100) == 101
    assert BOUND.over("completion", [1, 2, 3] * 1000, 10) is None  # token ids: not text


def test_on_the_loop_it_counts_characters_and_in_the_worker_utf8_bytes() -> None:
    # a character is at least one byte: the loop's bound encodes nothing and stays sound
    assert BOUND.over("completion", "é" * 500, 49) == 50
    assert BOUND.over("completion", "é" * 500, 50) is None
    # the worker's, on the text it would encode, counts its bytes (2 each)
    assert BOUND.over_text("é" * 500, 99) == 100
    assert BOUND.over_text("é" * 500, 100) is None
    assert BOUND.over_text("\ud800" * 10, 2) == 3  # a lone surrogate: 3 bytes


def test_chat_counts_each_messages_text_and_nothing_else() -> None:
    messages = [
        {"role": "system", "content": "a" * 300},
        {"role": "user", "content": [{"type": "text", "text": "b" * 300},
                                     {"type": "image_url", "image_url": {"url": "c" * 900}}]},
        {"role": "assistant", "content": None, "tool_calls": [{"x": "d" * 900}]},
    ]
    assert list(prompt_texts("chat", messages)) == ["a" * 300, "b" * 300]
    assert BOUND.over("chat", messages, 59) == 60
    assert BOUND.over("chat", messages, 60) is None
    assert BOUND.over("chat", "not a list", 0) is None


def test_only_exact_json_types_are_read() -> None:
    class Sneaky(dict[str, Any]):
        def get(self, *args: Any) -> Any:
            raise AssertionError("a subclass's methods never run on the loop")

    assert list(prompt_texts("chat", [Sneaky(content="x" * 100), {"content": "y"}])) == ["y"]
    assert list(prompt_texts("completion", ("x",))) == []


def test_the_many_messages_markup_is_bounded_in_the_worker_only() -> None:
    # 1500 empty messages: no text for the loop's bound; their rendered markup is plenty
    messages = [{"role": "user", "content": ""}] * 1500
    assert BOUND.over("chat", messages, 100) is None
    rendered = "<|im_start|>user\n<|im_end|>\n" * 1500
    assert BOUND.over_text(rendered, 100) == -(-len(rendered) // 10)


def test_the_loop_looks_at_a_bounded_number_of_messages_and_parts() -> None:
    # 150,000 parts in one message (4 MB, one message: under the message cap): the loop's
    # bound reads the first LOOP_NODES; what it proves from them still holds
    parts = [{"type": "text", "text": "x" * 20}] * 150_000
    messages = [{"role": "user", "content": parts}]
    assert len(list(prompt_texts("chat", messages, LOOP_NODES))) == LOOP_NODES - 1
    assert len(list(prompt_texts("chat", messages))) == 150_000
    assert BOUND.over("chat", messages, 100) == (LOOP_NODES - 1) * 2
    assert BOUND.over("chat", messages, (LOOP_NODES - 1) * 2) is None  # the rest unread


def test_ascii_only_bounds_ascii_text_only() -> None:
    bound = PromptBound(10, ascii_only=True)
    assert bound.over("completion", "x" * 1000, 10) == 100
    assert bound.over("completion", "x" * 999 + "é", 10) is None
    assert bound.over_text("x" * 1000, 10) == 100
    assert bound.over_text("x" * 999 + "é", 10) is None


def test_one_conversion_from_the_tokenizers_longest_token() -> None:
    from modelfiles.token_bound import LongestToken

    assert PromptBound.of(LongestToken(17, True)) == PromptBound(17, True)
    assert PromptBound.of(None) is None


def test_the_wire_form_round_trips_and_nonsense_is_ignored() -> None:
    entry = {"id": "m", "token_bound": PromptBound(17, True).report()}
    assert PromptBound.from_report(entry) == PromptBound(17, True)
    for bad in ({}, {"token_bound": None}, {"token_bound": {"max_token_bytes": 0}},
                {"token_bound": {"max_token_bytes": True}},
                {"token_bound": {"max_token_bytes": 5, "ascii_only": "no"}},
                {"token_bound": [17]}):
        assert PromptBound.from_report(bad) is None
