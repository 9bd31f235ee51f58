"""OpenAI request bodies (pydantic, at the edge) and their translation to engine inputs.

Unknown fields are ignored, as OpenAI-compatible servers do; fields that would change the
answer but that the engine does not implement (n > 1, logprobs, penalties) are refused with a
400 naming the field, never silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from backend.engine.sampling import SamplingParams

from .errors import BadRequest

# Strict types: "10" is not an integer and 1 is not a boolean. Floats accept integers.
Number = float


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: StrictBool | None = False
    # vLLM's extension: usage (running counts) on every chunk, when include_usage is set
    continuous_usage_stats: StrictBool | None = False


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: StrictStr | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool | None = False
    n: StrictInt | None = 1
    best_of: StrictInt | None = None
    logprobs: Any = None
    top_logprobs: StrictInt | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    priority: StrictInt | None = 0
    cache_salt: StrictStr | None = None
    user: StrictStr | None = None

    def check_supported(self) -> None:
        if self.n is not None and self.n != 1:
            raise BadRequest("only n=1 is supported", "n")
        if self.best_of is not None and self.best_of != 1:
            raise BadRequest("only best_of=1 is supported", "best_of")
        if self.logprobs not in (None, False, 0):
            raise BadRequest("logprobs are not supported", "logprobs")
        if self.top_logprobs:
            raise BadRequest("top_logprobs are not supported", "top_logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise BadRequest(f"{name} is not supported (only 0)", name)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options
                                           and self.stream_options.continuous_usage_stats)

    def sampling_params(self, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
        """Engine parameters; raises the engine's InvalidRequestError for bad values."""
        if self.max_completion_tokens is not None:
            max_tokens = self.max_completion_tokens
            if max_tokens <= 0:
                raise BadRequest("max_completion_tokens must be >= 1", "max_completion_tokens")
        elif self.max_tokens is not None:
            max_tokens = self.max_tokens
        else:
            # Absent: as much as the context leaves (at least 1, so that an over-long prompt
            # is reported as such rather than as a bad max_tokens).
            max_tokens = max(1, max_model_len - num_prompt_tokens)
        stop: tuple[str, ...]
        if self.stop is None:
            stop = ()
        elif isinstance(self.stop, str):
            stop = (self.stop,) if self.stop else ()
        else:
            stop = tuple(s for s in self.stop if s)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
        )


class ChatCompletionRequest(_GenerationRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)


class CompletionRequest(_GenerationRequest):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    echo: StrictBool | None = False
    suffix: StrictStr | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise BadRequest("echo is not supported", "echo")
        if self.suffix:
            raise BadRequest("suffix is not supported", "suffix")


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: StrictStr | None = None
    prompt: StrictStr | list[StrictInt] | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool | None = True


Kind = Literal["chat", "completion"]
