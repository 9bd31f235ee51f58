"""OpenAI's ``logprobs`` objects from the engine's per-token ``TokenLogprob``s.

The engine reports logprobs of the model's raw distribution (``log_softmax`` of the logits,
before temperature, penalties, logit bias, top-k and top-p: vLLM's default); see
docs/backend.md. Every output token has one, the stop token included (the tokens that
``usage.completion_tokens`` counts). A token's string is its own decoding (special tokens
kept), so a token holding part of a UTF-8 character reads as U+FFFD, as in vLLM.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from backend.engine.outputs import TokenLogprob
from modelfiles.tokenizer import Tokenizer

Entries = Sequence[tuple[int, TokenLogprob]]  # (token id, its logprobs) per output token
FLOOR = -9999.0  # the lowest logprob reported (JSON has no -inf), as vLLM


class LogprobFormat:
    """Builds the chat and completion shapes; token strings decoded once each."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = 1 << 16) -> None:
        self._tokenizer = tokenizer
        self.token = functools.lru_cache(maxsize=cache_size)(self._decode)

    def _decode(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token(token_id)
        return {"token": text, "logprob": max(logprob, FLOOR), "bytes": list(text.encode())}

    def chat(self, entries: Entries) -> dict[str, Any]:
        """``choices[].logprobs`` of a chat completion (or of one chunk)."""
        return {"content": [
            {**self._entry(tid, lp.logprob),
             "top_logprobs": [self._entry(t, v) for t, v in lp.top]}
            for tid, lp in entries], "refusal": None}

    def completion(self, entries: Entries, offset: int) -> tuple[dict[str, Any], int]:
        """``choices[].logprobs`` of a legacy completion (or of one chunk) whose first token
        starts at character ``offset`` of the text; and the offset after its last token.
        ``top_logprobs`` per token: the top ones and the sampled token (up to n + 1, as
        OpenAI and vLLM)."""
        tokens: list[str] = []
        token_logprobs: list[float] = []
        top: list[dict[str, float]] = []
        offsets: list[int] = []
        for tid, lp in entries:
            text = self.token(tid)
            tokens.append(text)
            token_logprobs.append(max(lp.logprob, FLOOR))
            alternatives = {self.token(t): max(v, FLOOR) for t, v in lp.top}
            alternatives.setdefault(text, max(lp.logprob, FLOOR))
            top.append(alternatives)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": offsets}, offset
