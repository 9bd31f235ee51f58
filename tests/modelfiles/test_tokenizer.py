"""Tokenizer and chat template, checked against transformers."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers/huggingface_hub read it
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest

from modelfiles.errors import InvalidMessagesError, MissingFileError, TemplateError
from modelfiles.tiny_model import write_tiny_model
from modelfiles.tokenizer import Tokenizer

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello 🙂, what is 中文 for café?"},
    {"role": "assistant", "content": "It is 咖啡馆."},
    {"role": "user", "content": "Thanks!"},
]
TEXTS = [
    "Hello world",
    "  leading spaces and\ttabs\nnew lines  ",
    "Emoji 🙂🚀🌧️ and CJK 中文 日本語 한국어, accents: naïve café Zürich",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="module")
def hf_tok(tiny_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


def variant(tiny_dir: Path, dst: Path, config: dict[str, Any] | None = None,
            jinja: str | None = None, strip_post_processor: bool = False) -> Path:
    """A copy of the tiny tokenizer files with a different config / template."""
    dst.mkdir(parents=True, exist_ok=True)
    data = json.loads((tiny_dir / "tokenizer.json").read_text(encoding="utf-8"))
    if strip_post_processor:
        data["post_processor"] = None
    (dst / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    base = json.loads((tiny_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    (dst / "tokenizer_config.json").write_text(json.dumps({**base, **(config or {})}))
    if jinja is not None:
        (dst / "chat_template.jinja").write_text(jinja, encoding="utf-8")
    return dst


def hf_render(path: Path, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    from transformers import AutoTokenizer

    out = AutoTokenizer.from_pretrained(path).apply_chat_template(
        messages, tokenize=False, **kwargs
    )
    assert isinstance(out, str)
    return out


# ---------------------------------------------------------------- encode / decode


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip_and_hf_parity(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    with_bos = tok.encode(text)
    assert with_bos == [tok.bos_token_id, *ids] == hf_tok.encode(text)
    for skip in (True, False):
        assert tok.decode(with_bos, skip_special_tokens=skip) == hf_tok.decode(
            with_bos, skip_special_tokens=skip
        )


def test_multibyte_characters_use_learned_merges(tok: Tokenizer) -> None:
    # "é" is two bytes; the corpus makes BPE learn a single token for it.
    assert len(tok.encode("é", add_special_tokens=False)) == 1
    assert len(tok.encode("🙂", add_special_tokens=False)) < 4


def test_properties(tok: Tokenizer, tiny_dir: Path) -> None:
    assert tok.vocab_size == 1024
    assert tok.bos_token_id == 0
    assert tok.eos_token_ids == (3, 1)  # <|im_end|> from tokenizer_config, then generation_config
    assert set(tok.all_special_ids) == {0, 1, 2, 3}
    assert tok.sha256 == hashlib.sha256((tiny_dir / "tokenizer.json").read_bytes()).hexdigest()
    template = (tiny_dir / "chat_template.jinja").read_bytes()
    assert tok.chat_template_sha256 == hashlib.sha256(template).hexdigest()
    assert tok.decode(tok.encode("<|im_end|>hi", add_special_tokens=False)) == "hi"


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(MissingFileError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize(
    ("config", "strip"),
    [({"add_bos_token": False}, False), ({"add_bos_token": True}, True),
     ({"add_bos_token": True, "add_eos_token": True}, False), ({}, True),
     ({"add_bos_token": False, "tokenizer_class": "LlamaTokenizerFast"}, False)],
)
def test_bos_policy_follows_post_processor_like_hf(tiny_dir: Path, tmp_path: Path,
                                                   config: dict[str, Any], strip: bool) -> None:
    from transformers import AutoTokenizer

    path = variant(tiny_dir, tmp_path / "v", config=config, strip_post_processor=strip)
    ours, theirs = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
    # transformers v5: tokenizer.json's post-processor wins over add_bos_token in the config.
    assert (ours.encode("hi")[0] == 0) is (not strip)


def test_generation_config_eos_ids_are_merged(tiny_dir: Path, tmp_path: Path) -> None:
    path = variant(tiny_dir, tmp_path / "v")
    assert Tokenizer.from_dir(path).eos_token_ids == (3,)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    assert Tokenizer.from_dir(path).eos_token_ids == (3, 1)


# ---------------------------------------------------------------- chat template


@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_hf(tok: Tokenizer, hf_tok: Any, gen: bool) -> None:
    ours = tok.apply_chat_template(MESSAGES, add_generation_prompt=gen)
    assert ours == hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=False)
    assert ours.startswith("<|begin_of_text|><|im_start|>system\nYou are terse.<|im_end|>\n")
    assert ours.endswith("<|im_start|>assistant\n") is gen


def test_template_precedence_string_list_and_file(tiny_dir: Path, tmp_path: Path) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    as_string = variant(tiny_dir, tmp_path / "s", {"chat_template": "S:{{ messages[0].content }}"})
    assert Tokenizer.from_dir(as_string).apply_chat_template(msgs) == "S:hi" == hf_render(
        as_string, msgs
    )
    named = [
        {"name": "default", "template": "D:{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T:{{ tools | length }}"},
    ]
    as_list = variant(tiny_dir, tmp_path / "l", {"chat_template": named})
    listed = Tokenizer.from_dir(as_list)
    assert listed.apply_chat_template(msgs) == "D:hi" == hf_render(as_list, msgs)
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert listed.apply_chat_template(msgs, tools=tools) == "T:1" == hf_render(
        as_list, msgs, tools=tools
    )
    assert listed.chat_template_sha256 == hashlib.sha256(b"D:{{ messages[0].content }}").hexdigest()
    # chat_template.jinja wins over tokenizer_config's template, as in transformers.
    both = variant(tiny_dir, tmp_path / "b", {"chat_template": "S:x"}, jinja="F:{{ bos_token }}")
    assert Tokenizer.from_dir(both).apply_chat_template(msgs) == "F:<|begin_of_text|>"
    assert hf_render(both, msgs) == "F:<|begin_of_text|>"


def test_no_template_and_no_default(tiny_dir: Path, tmp_path: Path) -> None:
    bare = Tokenizer.from_dir(variant(tiny_dir, tmp_path / "n"))
    assert bare.chat_template_sha256 is None
    with pytest.raises(TemplateError, match="model has no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
    named = {"chat_template": [{"name": "a", "template": "x"}]}
    only_named = variant(tiny_dir, tmp_path / "o", named)
    with pytest.raises(TemplateError, match="default"):
        Tokenizer.from_dir(only_named).apply_chat_template([{"role": "user", "content": "hi"}])


def test_raise_exception_becomes_template_error(tok: Tokenizer) -> None:
    with pytest.raises(TemplateError, match="The system message must come first"):
        tok.apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
        )
    with pytest.raises(TemplateError, match="Unsupported role: developer"):
        tok.apply_chat_template([{"role": "developer", "content": "a"}])


def _with_template(tiny_dir: Path, path: Path, template: str) -> Tokenizer:
    return Tokenizer.from_dir(variant(tiny_dir, path, jinja=template))


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{{ raise_exception.__globals__['os'] }}",
        "{% set ns = namespace(_secret=1) %}{{ ns._secret }}",
        "{{ dict.__call__.__globals__ }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{% for x in %}",  # syntax error
        "{{ 'a' + none_such.attr }}",
    ],
)
def test_sandbox_escapes_are_template_errors(tiny_dir: Path, tmp_path: Path, template: str) -> None:
    t = _with_template(tiny_dir, tmp_path / "t", template)
    with pytest.raises(TemplateError):
        t.apply_chat_template([{"role": "user", "content": "hi"}])


def test_unsafe_attribute_renders_nothing(tiny_dir: Path, tmp_path: Path) -> None:
    t = _with_template(tiny_dir, tmp_path / "t", "[{{ ''.__class__ }}]")
    assert t.apply_chat_template([{"role": "user", "content": "hi"}]) == "[]"


def test_hf_globals_filters_and_kwargs(tiny_dir: Path, tmp_path: Path) -> None:
    template = (
        "{{ messages[0].content | tojson }}|{{ tools | tojson(indent=1) }}|{{ foo }}|"
        "{{ eos_token }}|{{ dict(a=1) | tojson }}|{{ add_generation_prompt }}|"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}{{ ns.n }}|"
        "{{ documents is none }}|{{ strftime_now('%Y') | length }}"
        "\n  {% if true %}\n  x\n{% endif %}"
    )
    path = variant(tiny_dir, tmp_path / "g", jinja=template)
    msgs = [{"role": "user", "content": "<b>é \"q\"</b>", "name": None}]
    tools = [{"type": "function", "function": {"name": "f", "description": "ü"}}]
    ours = Tokenizer.from_dir(path).apply_chat_template(msgs, tools=tools, foo="bar")
    assert ours == hf_render(path, msgs, tools=tools, foo="bar", add_generation_prompt=True)
    assert ours.startswith('"<b>é \\"q\\"</b>"|')
    assert "|bar|<|im_end|>|" in ours and '{"a": 1}' in ours and "|True|1|True|4" in ours


def test_content_parts_are_joined_and_none_keys_dropped(tok: Tokenizer) -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    rendered = tok.apply_chat_template([{"role": "user", "content": parts, "name": None}])
    assert "<|im_start|>user\none\ntwo<|im_end|>" in rendered


def test_compiled_template_is_cached(tok: Tokenizer) -> None:
    tok.apply_chat_template(MESSAGES)
    compiled = dict(tok._compiled)
    tok.apply_chat_template(MESSAGES[:2])
    assert tok._compiled == compiled and len(compiled) == 1


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [],
        None,
        ["hello"],
        [{"content": "no role"}],
        [{"role": 3, "content": "x"}],
        [{"role": "user"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": [{"type": "text", "text": 1}]}],
        [{"role": "user", "content": ["raw"]}],
    ],
)
def test_bad_messages_are_invalid_requests(tok: Tokenizer, messages: Any) -> None:
    with pytest.raises(InvalidMessagesError) as info:
        tok.apply_chat_template(messages)
    assert info.value.param == "messages"


def test_tokenizer_dir_copy_is_independent(tiny_dir: Path, tmp_path: Path) -> None:
    # A model dir with only tokenizer.json still loads (no config, no template).
    shutil.copy(tiny_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    bare = Tokenizer.from_dir(tmp_path)
    assert bare.bos_token_id is None and bare.eos_token_ids == ()
    assert bare.encode("hi") == [0, *bare.encode("hi", add_special_tokens=False)]
