"""What the engine hands back: output deltas, per-request timings, state snapshots."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass(slots=True, frozen=True)
class RequestMetrics:
    """Per-request timings on the engine's monotonic clock (seconds)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    token_times: tuple[float, ...]
    num_preemptions: int
    tokens_after_abort: int | None  # tokens generated between abort() and the abort taking effect
    # (start position, tokens, step start, step end) per prefill chunk (Sequence.prefill_chunks)
    prefill_chunks: tuple[tuple[int, int, float, float], ...] = ()
    abort_time: float | None = None  # when abort() was asked for (a client left), if it was

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model's raw distribution
    (``log_softmax`` of its logits) and the ``SamplingParams.logprobs`` most likely
    tokens there, most likely first: (token id, logprob) each."""

    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(slots=True, frozen=True)
class OutputDelta:
    """New output of one request since its previous delta."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    token_times: tuple[float, ...]
    finished: bool
    finish_reason: str | None  # stop | length | abort, on the final delta
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int  # total so far, over all choices
    metrics: RequestMetrics | None = None  # on the final delta
    # one per token of token_ids, for requests that asked (SamplingParams.logprobs)
    logprobs: tuple[TokenLogprob, ...] | None = None
    # the choice (0..n-1) these tokens belong to. With n > 1, a choice's last delta has
    # its finish_reason; only the request's last one (its last choice to end) is finished.
    index: int = 0


@dataclass(slots=True, frozen=True)
class EngineState:
    """A consistent snapshot taken between two steps."""

    kv_blocks_total: int
    kv_blocks_free: int  # free or cached-free (both can be allocated)
    kv_blocks_cached: int  # cached-free: reusable by a prefix hit until evicted
    block_size: int
    running: int
    waiting: int
    preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_query_tokens: int
    prefill_tokens_saved: int
    prefix_cache_evictions: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    steps: int
    generated_tokens: int
    aborted: int
    max_tokens_after_abort: int
    # bytes of every tensor the engine holds for the model's weights (packed and quantized
    # copies included; LlamaForCausalLM.weight_bytes)
    weight_bytes: int = 0
    # speculative decoding (spec.py), since start: drafts proposed and accepted, the
    # sequence-steps that verified drafts and the tokens they produced, drafting time
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_steps: int = 0
    spec_emitted_tokens: int = 0
    spec_draft_seconds: float = 0.0
    # constrained decoding (grammar.py): choices holding a grammar's state now; grammars
    # compiled and requests whose grammar was already compiled, since start
    grammar_sequences: int = 0
    grammar_compiles: int = 0
    grammar_cache_hits: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted over proposed drafts (0 before any)."""
        p = self.spec_proposed_tokens
        return self.spec_accepted_tokens / p if p else 0.0

    @property
    def spec_tokens_per_step(self) -> float:
        """Tokens a verifying sequence got per step (accepted + 1; 0 before any)."""
        v = self.spec_verify_steps
        return self.spec_emitted_tokens / v if v else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["spec_acceptance_rate"] = self.spec_acceptance_rate
        out["spec_tokens_per_step"] = self.spec_tokens_per_step
        return out


def merge_deltas(deltas: list[OutputDelta]) -> OutputDelta:
    """One delta for several tokens of one choice made in one step (the last one's
    status, every token's text, ids, times and logprobs)."""
    last = deltas[-1]
    if len(deltas) == 1:
        return last
    lps = None if last.logprobs is None else tuple(
        lp for d in deltas for lp in (d.logprobs or ()))
    return replace(
        last, text="".join(d.text for d in deltas),
        token_ids=tuple(t for d in deltas for t in d.token_ids),
        token_times=tuple(t for d in deltas for t in d.token_times), logprobs=lps)
