"""The longest token: its value, that the bound it gives is never above a real count, and
the tokenizers it refuses to bound (where a text could have fewer tokens than it says)."""

from __future__ import annotations

import math

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, models, normalizers, pre_tokenizers

from modelfiles.tiny_model import SPECIAL_TOKENS, ensure_tiny_model, train_tokenizer
from modelfiles.token_bound import LongestToken, longest_token
from modelfiles.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return Tokenizer.from_dir(ensure_tiny_model())


def test_the_tiny_tokenizers_longest_token_is_its_widest_special_token(tiny: Tokenizer) -> None:
    assert tiny.longest_token == LongestToken(max(len(t) for t in SPECIAL_TOKENS), False)


def bounded_below(tok: Tokenizer, text: str) -> None:
    longest = tok.longest_token
    assert longest is not None
    count = len(tok.encode(text, add_special_tokens=False))
    assert count >= math.ceil(len(text.encode("utf-8")) / longest.nbytes)


pieces = st.one_of(st.text(max_size=40), st.sampled_from(list(SPECIAL_TOKENS)),
                   st.sampled_from([" the", "tokenizer", "  ", "\n\n", "everything"]))


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(pieces, max_size=30))
def test_the_bound_never_exceeds_the_real_count(tiny: Tokenizer, parts: list[str]) -> None:
    bounded_below(tiny, "".join(parts))


def test_worst_cases_for_the_tiny_tokenizer(tiny: Tokenizer) -> None:
    for text in ("<|begin_of_text|>" * 50, " everything" * 50, "word " * 1000,
                 "\U0001f600" * 20, "a"):
        bounded_below(tiny, text)


def test_long_texts_count_the_same_in_a_worker(tiny: Tokenizer) -> None:
    text = "héllo wörld <|im_end|> 123 " * 200
    assert tiny.encode_long(text) == tiny.encode(text)
    assert tiny.count(text, add_special_tokens=False) == len(tiny.encode(text, False))


# ---- byte-fallback tokenizers (Llama 2 / Mistral style) ---------------------------------

def fallback_bpe() -> tokenizers.Tokenizer:
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for word in ("▁", "a", "b", "▁a", "▁ab", "ab"):
        vocab[word] = len(vocab)
    merges = [("a", "b"), ("▁", "a"), ("▁a", "b")]
    tok = tokenizers.Tokenizer(models.BPE(vocab, merges, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    return tok


def test_a_byte_fallback_bpe_is_bounded_in_utf8_bytes() -> None:
    tok = Tokenizer(fallback_bpe(), sha256="x")
    longest = tok.longest_token
    assert longest == LongestToken(len("<0x00>"), False)
    for text in ("ab ab ab", "é€😀", " " * 40, "ab" * 100):
        bounded_below(tok, text)


# ---- what gets no bound -----------------------------------------------------------------

def byte_level() -> tokenizers.Tokenizer:
    return train_tokenizer("hello world, the tokenizer\n" * 20)


def test_normalizers_that_may_shrink_text_give_no_bound_or_an_ascii_only_one() -> None:
    tok = byte_level()
    plain = longest_token(tok)
    assert plain is not None and not plain.ascii_only
    tok.normalizer = normalizers.NFC()
    assert longest_token(tok) == LongestToken(plain.nbytes, True)
    tok.normalizer = normalizers.Sequence([normalizers.Lowercase(), normalizers.Prepend("x")])
    lowered = longest_token(tok)
    assert lowered is not None and lowered.ascii_only
    for shrinking in (normalizers.Strip(), normalizers.BertNormalizer(),
                      normalizers.Replace("abc", "d"),
                      normalizers.Replace(tokenizers.Regex("a+"), "a")):
        tok.normalizer = shrinking
        assert longest_token(tok) is None, shrinking


def test_pre_tokenizers_that_drop_text_give_no_bound() -> None:
    tok = byte_level()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                 pre_tokenizers.ByteLevel()])
    assert longest_token(tok) is None
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(r"\s+"), "removed"), pre_tokenizers.ByteLevel()])
    assert longest_token(tok) is None
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(r"\s+"), "isolated"), pre_tokenizers.Digits(),
        pre_tokenizers.ByteLevel(use_regex=False)])
    assert longest_token(tok) is not None


def test_added_tokens_that_swallow_whitespace_and_truncation_give_no_bound() -> None:
    tok = byte_level()
    tok.add_special_tokens([AddedToken("<x>", rstrip=True)])
    assert longest_token(tok) is None
    tok = byte_level()
    tok.enable_truncation(16)
    assert longest_token(tok) is None


def test_models_that_fold_unknown_text_give_no_bound() -> None:
    for model in (models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"),
                  models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"),
                  models.Unigram([("a", 0.0), ("<unk>", 0.0)], 1),
                  models.BPE({"a": 0, "[UNK]": 1}, [], unk_token="[UNK]", fuse_unk=True)):
        assert longest_token(tokenizers.Tokenizer(model)) is None, model
    missing_byte = byte_level()
    vocab = missing_byte.get_vocab()
    vocab.pop("Ā")  # byte 0x00 of the byte-level alphabet: that byte would be dropped
    dropping = tokenizers.Tokenizer(models.BPE(vocab, []))
    dropping.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert longest_token(dropping) is None
    vocab["Ā"] = len(vocab) + 1
    dropping = tokenizers.Tokenizer(models.BPE(vocab, []))
    dropping.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert longest_token(dropping) is not None
