"""The incremental detokenizer, over the tiny model's tokenizer."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.engine.detokenizer import IncrementalDetokenizer
from modelfiles.tiny_model import write_tiny_model
from modelfiles.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


# ---------------------------------------------------------------- incremental detokenizer


def _byte_token_ids(tok: Tokenizer) -> list[int]:
    """Ids of the 256 single-byte tokens (GPT-2 byte-to-unicode alphabet)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    ids = [tok.token_to_id(mapping[b]) for b in range(256)]
    assert all(i is not None for i in ids)
    return [i for i in ids if i is not None]


def _stream(tok: Tokenizer, chunks: Sequence[Sequence[int]], skip: bool = True,
            prompt: Sequence[int] | None = None) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt, skip_special_tokens=skip)
    return [detok.add(list(c)) for c in chunks], detok.flush()


def _chunks(ids: list[int], cuts: list[int]) -> Iterator[list[int]]:
    points = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    for a, b in itertools.pairwise(points):
        yield ids[a:b]
    yield []  # an empty step is legal


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_detokenizer_deltas_join_to_full_decode(tok: Tokenizer, data: st.DataObject) -> None:
    byte_ids = _byte_token_ids(tok)
    # Mix whole-character tokens, raw byte tokens (which split multi-byte characters) and specials.
    ids = data.draw(st.lists(st.one_of(
        st.integers(0, tok.vocab_size - 1),
        st.sampled_from(byte_ids[0x80:]),
        st.sampled_from(byte_ids),
    ), max_size=40))
    cuts = data.draw(st.lists(st.integers(0, 100), max_size=10))
    skip = data.draw(st.booleans())
    deltas, tail = _stream(tok, list(_chunks(ids, cuts)), skip=skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) + tail == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas + [tail])


def test_detokenizer_holds_back_split_characters(tok: Tokenizer) -> None:
    byte_ids = _byte_token_ids(tok)
    text = "a中🙂b"
    ids = [byte_ids[b] for b in text.encode("utf-8")]
    deltas, tail = _stream(tok, [[i] for i in ids])
    assert [d for d in deltas if d] == ["a", "中", "🙂", "b"] and tail == ""
    # An unfinished character is only emitted (as U+FFFD) by flush.
    deltas, tail = _stream(tok, [[i] for i in ids[:3]])
    assert "".join(deltas) == "a" and tail == "\ufffd"


def test_detokenizer_with_prompt_context_emits_only_new_text(tok: Tokenizer) -> None:
    prompt = tok.encode("The weather in the valley", add_special_tokens=False)
    gen = tok.encode(" was calm 🙂 and 中文 fine.", add_special_tokens=False)
    deltas, tail = _stream(tok, [[i] for i in gen], prompt=prompt)
    assert "".join(deltas) + tail == " was calm 🙂 and 中文 fine."


class _CountingTokenizer:
    def __init__(self, inner: Tokenizer) -> None:
        self.inner, self.max_window = inner, 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.max_window = max(self.max_window, len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_detokenizer_decodes_a_bounded_window(tok: Tokenizer) -> None:
    text = (Path(__file__).resolve().parents[3] / "modelfiles/data/corpus.txt").read_text()
    ids = tok.encode(text[:6000], add_special_tokens=False)
    counting = _CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, prompt_token_ids=ids[:50])
    out = "".join(detok.add([i]) for i in ids[50:]) + detok.flush()
    assert out == tok.decode(ids[50:])
    assert len(ids) > 1000 and counting.max_window <= 12  # O(window), not O(output)
    assert len(detok._ids) == 0
