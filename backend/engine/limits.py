"""What a request must satisfy to be served by an engine: a pure value, torch-free.

``RequestLimits`` depends only on settings fixed when the engine is built (vocabulary size,
context length), so any thread or process can check a request against it: the engine core
checks again when it adds the request, the asyncio front checks before anything is queued,
and the server before it answers.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidRequestError, PromptTooLongError
from .sampling import SamplingParams


@dataclass(slots=True, frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int  # prompt + generated tokens, at most (capped to the KV capacity)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``InvalidRequestError`` for a request this engine can never serve."""
        vocab_size, max_model_len = self.vocab_size, self.max_model_len
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be SamplingParams", "params")
        if not isinstance(prompt_token_ids, list) or not prompt_token_ids:
            raise InvalidRequestError("prompt must have at least one token", "prompt")
        for t in prompt_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                raise InvalidRequestError(
                    f"prompt token {t!r} is not an id in [0, {vocab_size})", "prompt")
        for t, _ in params.logit_bias:
            if t >= vocab_size:
                raise InvalidRequestError(
                    f"logit_bias token {t} is not an id in [0, {vocab_size})", "logit_bias")
        n = len(prompt_token_ids)
        if n >= max_model_len:
            raise PromptTooLongError(
                f"prompt has {n} tokens; this model serves at most {max_model_len} "
                f"tokens in all, so the prompt must be shorter than that", "prompt")
        if n + params.max_tokens > max_model_len:
            raise PromptTooLongError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = "
                f"{n + params.max_tokens} exceeds the maximum context length "
                f"{max_model_len}", "max_tokens")
