"""The model's tokenizer, loaded from a Hugging Face checkpoint directory.

Behaviour follows `transformers` (v5) `PreTrainedTokenizerFast` + `apply_chat_template` for the
same files, so that prompt token counts and rendered prompts match what users get from HF:

* `tokenizer.json` is loaded with the `tokenizers` library. Its post-processor alone decides
  what `encode(..., add_special_tokens=True)` adds (BOS or not): transformers v5 drops
  `add_bos_token` / `add_eos_token` from tokenizer_config.json whenever tokenizer.json exists,
  for every tokenizer class (checked against 5.24; v4's LlamaTokenizerFast still honoured them).
* The chat template: where it is read from and how it renders, see `chat_template`.
* `sha256` (of tokenizer.json's bytes) and `chat_template_sha256` name the versions every
  response reports and the prefix cache salts with.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken

from .chat_template import (
    TOKENIZER_CONFIG_FILE,
    build_environment,
    load_chat_template,
    normalize_messages,
    plain_copy,
)
from .errors import MissingFileError, ModelLoadError, TemplateError
from .jsonfile import read_json_object
from .token_bound import LongestToken, longest_token

TOKENIZER_FILE = "tokenizer.json"
GENERATION_CONFIG_FILE = "generation_config.json"

# The named special tokens HF passes to every chat template (`special_tokens_map`).
_SPECIAL_TOKEN_ATTRIBUTES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or a serialized AddedToken."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise ModelLoadError(f"{TOKENIZER_CONFIG_FILE}: cannot read special token {value!r}")




class Tokenizer:
    """A checkpoint's tokenizer: encode/decode, special ids and the chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        sha256: str,
        special_tokens: Mapping[str, str] | None = None,
        chat_template: str | Mapping[str, str] | None = None,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._backend = backend
        self._sha256 = sha256
        self._special_tokens = dict(special_tokens or {})
        self._chat_template = (
            dict(chat_template) if isinstance(chat_template, Mapping) else chat_template
        )
        self._env: ImmutableSandboxedEnvironment | None = None
        self._compiled: dict[str, jinja2.Template] = {}

        eos_ids: list[int] = []
        eos_id = self.token_to_id(self._special_tokens.get("eos_token"))
        for candidate in ([eos_id] if eos_id is not None else []) + list(extra_eos_token_ids):
            if candidate not in eos_ids:
                eos_ids.append(candidate)
        self._eos_token_ids = tuple(eos_ids)

        special = {
            tid for tid, tok in backend.get_added_tokens_decoder().items() if tok.special
        }
        special.update(
            tid for tid in (self.token_to_id(t) for t in self._special_tokens.values())
            if tid is not None
        )
        self._all_special_ids = tuple(sorted(special))
        self._longest: tuple[LongestToken | None] | None = None


    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, chat templates and generation_config.json."""
        root = Path(path)
        tokenizer_path = root / TOKENIZER_FILE
        if not tokenizer_path.is_file():
            raise MissingFileError(f"{TOKENIZER_FILE} not found in {root}")
        raw = tokenizer_path.read_bytes()
        try:
            backend = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise ModelLoadError(f"cannot parse {TOKENIZER_FILE}: {exc}") from exc

        config_path = root / TOKENIZER_CONFIG_FILE
        config = read_json_object(config_path) if config_path.is_file() else {}
        special_tokens = {
            attr: text
            for attr in _SPECIAL_TOKEN_ATTRIBUTES
            if (text := _token_text(config.get(attr))) is not None
        }
        # HF adds named special tokens that tokenizer.json lacks.
        missing = [t for t in special_tokens.values() if backend.token_to_id(t) is None]
        if missing:
            backend.add_special_tokens(
                [AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(missing)]
            )

        return cls(
            backend,
            sha256=hashlib.sha256(raw).hexdigest(),
            special_tokens=special_tokens,
            chat_template=load_chat_template(root, config),
            extra_eos_token_ids=_generation_eos_ids(root / GENERATION_CONFIG_FILE),
        )


    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (base vocab plus added tokens)."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """tokenizer_config's eos first, then generation_config's, without duplicates."""
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self._special_tokens.get("bos_token"))

    @property
    def all_special_ids(self) -> tuple[int, ...]:
        return self._all_special_ids

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self._special_tokens)

    @property
    def sha256(self) -> str:
        """Hex sha256 of the tokenizer.json bytes."""
        return self._sha256

    @property
    def chat_template(self) -> str | None:
        """The template used when no tools are passed (None if the model has none)."""
        if isinstance(self._chat_template, dict):
            return self._chat_template.get("default")
        return self._chat_template

    @property
    def chat_template_sha256(self) -> str | None:
        template = self.chat_template
        return None if template is None else hashlib.sha256(template.encode("utf-8")).hexdigest()

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def longest_token(self) -> LongestToken | None:
        """The widest token in UTF-8 bytes, where a length bound is sound (``token_bound``);
        read from the whole vocabulary on first use, so read it once at load."""
        if self._longest is None:
            self._longest = (longest_token(self._backend),)
        return self._longest[0]


    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_long(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``encode``, for a long text in a worker thread: the batch call releases the GIL
        (plain ``encode`` holds it throughout, stalling every other thread) and skips the
        offsets nobody reads."""
        return list(self._backend.encode_batch_fast(
            [text], add_special_tokens=add_special_tokens)[0].ids)

    def count(self, text: str, add_special_tokens: bool = True) -> int:
        """``len(encode(text))`` without building the list of ids; releases the GIL."""
        return len(self._backend.encode_batch_fast([text],
                                                   add_special_tokens=add_special_tokens)[0])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))


    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render messages to prompt text, as HF's apply_chat_template(..., tokenize=False)."""
        chat = normalize_messages(messages)
        template = self._select_template(tools)
        compiled = self._compile(template)
        # As HF: kwargs override the special tokens; everything visible is plain JSON data.
        variables = plain_copy({**self._special_tokens, **template_kwargs})
        try:
            return compiled.render(
                messages=chat,
                tools=plain_copy(tools),
                documents=plain_copy(documents),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as exc:  # raise_exception, SecurityError, UndefinedError
            raise TemplateError(str(exc) or type(exc).__name__) from exc
        except Exception as exc:  # a template may fail in plain Python ("a" + None)
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc

    def _select_template(self, tools: object) -> str:
        if isinstance(self._chat_template, dict):
            if tools is not None and "tool_use" in self._chat_template:
                return self._chat_template["tool_use"]
            if "default" in self._chat_template:
                return self._chat_template["default"]
            raise TemplateError(
                "model has several chat templates and none is named 'default': "
                + ", ".join(sorted(self._chat_template))
            )
        if self._chat_template is None:
            raise TemplateError("model has no chat template")
        return self._chat_template

    def _compile(self, template: str) -> jinja2.Template:
        compiled = self._compiled.get(template)
        if compiled is None:
            if self._env is None:
                self._env = build_environment()
            try:
                compiled = self._env.from_string(template)
            except jinja2.TemplateError as exc:
                raise TemplateError(f"invalid chat template: {exc}") from exc
            self._compiled[template] = compiled
        return compiled


def _generation_eos_ids(path: Path) -> list[int]:
    if not path.is_file():
        return []
    value = read_json_object(path).get("eos_token_id")
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ModelLoadError(f"{GENERATION_CONFIG_FILE}: eos_token_id must be an int or a list")
    return list(ids)
