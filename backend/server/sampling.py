"""A validated generation request (``protocol.contract``) as the engine's SamplingParams."""

from __future__ import annotations

from backend.engine.sampling import GrammarSpec, SamplingParams
from protocol.contract import ChatRequest, Request
from protocol.structured import NO_STRUCTURE, Structured


def sampling_params(req: Request, num_prompt_tokens: int, max_model_len: int,
                    structured: Structured = NO_STRUCTURE) -> SamplingParams:
    """Engine parameters; the engine raises its InvalidRequestError for bad values.

    ``req`` has passed the field policy against what the engine serves, so every field that
    could change the answer is one translated here; ``structured`` is what its
    ``response_format`` and ``tools`` ask (``protocol.structured.structured_of``).
    """
    if req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    elif req.max_tokens is not None:
        max_tokens = req.max_tokens
    else:
        # Absent: as much as the context leaves (at least 1, so that an over-long prompt
        # is reported as such rather than as a bad max_tokens).
        max_tokens = max(1, max_model_len - num_prompt_tokens)
    stop: tuple[str, ...]
    if req.stop is None:
        stop = ()
    elif isinstance(req.stop, str):
        stop = (req.stop,) if req.stop else ()
    else:
        stop = tuple(s for s in req.stop if s)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else float(req.min_p),
        seed=req.seed,
        stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=bool(req.ignore_eos),
        n=req.n or 1,
        presence_penalty=float(req.presence_penalty or 0.0),
        frequency_penalty=float(req.frequency_penalty or 0.0),
        logit_bias=tuple((int(k), float(v)) for k, v in (req.logit_bias or {}).items()),
        logprobs=logprobs(req),
        speculative=req.speculative is not False,
        grammar=grammar(structured),
    )


def grammar(structured: Structured) -> GrammarSpec | None:
    """The engine's constraint for a request's output (None: free text)."""
    if structured.grammar_kind is None or structured.grammar is None:
        return None
    return GrammarSpec(structured.grammar_kind, structured.grammar, structured.param)


def logprobs(req: Request) -> int | None:
    """How many top logprobs per token (None: no logprobs): chat's ``logprobs: true`` with
    ``top_logprobs`` (0-20), completions' ``logprobs`` (0-5)."""
    if isinstance(req, ChatRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs
