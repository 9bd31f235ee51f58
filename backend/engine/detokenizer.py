"""Incremental detokenization for streaming: emit new text per step, never half a character.

The technique is vLLM's prefix/read offsets. The token list is cut in three parts:

    ids:  [ ... emitted and forgotten ... | prefix window | unread tokens ]
                                          ^prefix_offset ^read_offset

`decode(ids[prefix:read])` is text we have already emitted; `decode(ids[prefix:])` is that text
plus the new text. Decoding from a few tokens back (not from `read`) keeps decoders that strip or
add a leading space (SentencePiece's Metaspace) consistent. When the longer decode ends in U+FFFD,
the last tokens hold an incomplete UTF-8 sequence, so nothing is emitted and the offsets stay; the
next call decodes a longer window that (usually) completes the character.

Invariant (byte-level BPE): `read_offset` only ever moves to a position where the decode did not
end in U+FFFD, i.e. a character boundary, so every window starts on a character boundary and the
emitted deltas concatenate to `decode(all ids)`. Each call costs O(window), and tokens before the
window are dropped, so memory stays bounded however long the output grows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# How many prompt tokens to keep as left context for the first decode (vLLM uses 5).
INITIAL_CONTEXT_TOKENS = 5


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, one step at a time.

    `prompt_token_ids` only provides left context for the first tokens (for correct spacing); the
    prompt's own text is never emitted. (A character split across the prompt/output boundary
    belongs to the prompt and is not emitted either.)
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_token_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids or ())[-INITIAL_CONTEXT_TOKENS:]
        # Only the window is kept: ids[0] is the token at prefix_offset.
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(0, self._read_offset)
        self._finished = False

    def _decode(self, start: int, end: int | None = None) -> str:
        ids = self._ids[start:end]
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; return the newly completed text (possibly "")."""
        if self._finished:
            raise RuntimeError("add() after flush()")
        self._ids.extend(token_ids)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            # Nothing new yet, or an incomplete UTF-8 sequence at the end: hold back.
            return ""
        delta = new_text[len(self._prefix_text):]
        # The old read position becomes the new prefix start; everything before it is dropped.
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(0, self._read_offset)
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (replacement characters allowed); call once at the end."""
        if self._finished:
            return ""
        self._finished = True
        new_text = self._decode(self._prefix_offset)
        delta = new_text[len(self._prefix_text):]
        self._ids.clear()
        self._prefix_text = ""
        self._read_offset = 0
        return delta
