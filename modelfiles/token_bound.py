"""The longest token of a tokenizer, in UTF-8 bytes: what makes a cheap lower bound sound.

A prompt of ``B`` UTF-8 bytes has at least ``ceil(B / longest)`` tokens when every token
covers at most ``longest`` bytes of the text and no byte of the text goes uncovered. That
lets a server refuse a prompt that provably exceeds a limit without tokenizing it (a 3.8 MB
body otherwise costs seconds of CPU and hundreds of MiB). ``longest_token`` reads the
serialized tokenizer once and returns the figure only where it can show both conditions:

* **The model covers every byte.** A ``BPE`` model that is byte-level (a ``ByteLevel``
  pre-tokenizer maps each byte to one of 256 alphabet characters, all in the vocabulary) or
  has ``byte_fallback`` with all 256 ``<0xNN>`` tokens: no character is dropped or folded
  into an unknown token. Unigram, WordPiece and WordLevel can map a long run of unknown text
  to one ``[UNK]``, so they get no bound.
* **Nothing before the model shrinks the text.** The normalizer is absent, or made of
  ``Prepend`` and string ``Replace`` rules that never make a match shorter in bytes. The
  Unicode forms (NFC, NFD, NFKC, NFKD) and ``Lowercase`` can shrink non-ASCII text (U+2126
  OHM SIGN becomes the 2-byte omega under NFC; U+212A KELVIN SIGN the 1-byte ``k`` under
  Lowercase) but are the identity on ASCII, so with them the bound holds for ASCII text only
  (``ascii_only``). Any other normalizer (Strip, BertNormalizer, Precompiled, regex Replace)
  means no bound. Pre-tokenizers must keep every character (ByteLevel, Metaspace, Digits,
  UnicodeScripts, and Split or Punctuation without ``Removed``); Whitespace and its kin
  drop text, so no bound. No truncation (it would cap the count).
* **Added tokens are no wider than their text.** An added token matches its own content in
  the text, so it covers ``len(content)`` bytes, unless it has ``lstrip``/``rstrip``, which
  swallow any amount of neighbouring whitespace: then no bound.

The longest token is the maximum over the vocabulary (a byte-level token covers one byte
per character; any other token at most its own UTF-8 length: prefixes such as ``##`` and
``<0xNN>`` spellings only overstate it, which keeps the bound sound) and the added tokens.
Post-processors and chat templates only add tokens, so a count of the text alone stays a
lower bound of the rendered prompt's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import tokenizers
from tokenizers import pre_tokenizers

# Normalizers that are the identity on ASCII text but may shrink other text.
_ASCII_IDENTITY_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"})
_SPLITTING_PRE_TOKENIZERS = frozenset({"Split", "Punctuation"})  # sound unless "Removed"


@dataclass(slots=True, frozen=True)
class LongestToken:
    """At most ``nbytes`` UTF-8 bytes of text per token; with ``ascii_only`` this holds for
    ASCII text only (a normalizer that may shrink other text)."""

    nbytes: int
    ascii_only: bool = False


def longest_token(backend: tokenizers.Tokenizer) -> LongestToken | None:
    """The tokenizer's longest token, or None where the bound would not be sound."""
    spec: dict[str, Any] = json.loads(backend.to_str())
    if spec.get("truncation") is not None:
        return None
    ascii_only = _normalizer_ascii_only(spec.get("normalizer"))
    if ascii_only is None:
        return None
    pre = spec.get("pre_tokenizer")
    if not _keeps_text(pre):
        return None
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    if model.get("type") != "BPE" or not isinstance(vocab, dict):
        return None
    if _has_byte_level(pre):
        alphabet = set(pre_tokenizers.ByteLevel.alphabet())
        if not alphabet <= vocab.keys():
            return None
        widest = max((len(t) if set(t) <= alphabet else len(t.encode("utf-8"))
                      for t in vocab), default=1)
    elif model.get("byte_fallback") is True:
        if any(f"<0x{b:02X}>" not in vocab for b in range(256)):
            return None
        widest = max((len(t.encode("utf-8")) for t in vocab), default=1)
    else:
        return None
    for added in spec.get("added_tokens") or []:
        if added.get("lstrip") or added.get("rstrip"):
            return None
        widest = max(widest, len(str(added.get("content", "")).encode("utf-8")))
    return LongestToken(max(1, widest), ascii_only)


def _normalizer_ascii_only(node: Any) -> bool | None:
    """None: may shrink any text; False: never shrinks; True: never shrinks ASCII text."""
    if node is None:
        return False
    kind = node.get("type")
    if kind == "Sequence":
        parts = [_normalizer_ascii_only(n) for n in node.get("normalizers") or []]
        return None if None in parts else any(parts)
    if kind == "Prepend":
        return False
    if kind == "Replace":
        pattern = node.get("pattern") or {}
        old, new = pattern.get("String"), node.get("content")
        if isinstance(old, str) and old and isinstance(new, str) \
                and len(new.encode("utf-8")) >= len(old.encode("utf-8")):
            return False
        return None
    if kind in _ASCII_IDENTITY_NORMALIZERS:
        return True
    return None


def _keeps_text(node: Any) -> bool:
    """Every character of the text reaches the model (none dropped by a split)."""
    if node is None:
        return True
    kind = node.get("type")
    if kind == "Sequence":
        return all(_keeps_text(n) for n in node.get("pretokenizers") or [])
    if kind in _SPLITTING_PRE_TOKENIZERS:
        return bool(node.get("behavior") != "Removed")
    return kind in _KEEPING_PRE_TOKENIZERS


def _has_byte_level(node: Any) -> bool:
    if node is None:
        return False
    if node.get("type") == "Sequence":
        return any(_has_byte_level(n) for n in node.get("pretokenizers") or [])
    return bool(node.get("type") == "ByteLevel")
