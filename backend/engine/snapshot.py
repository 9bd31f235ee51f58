"""``LLMEngine.state()``: the engine's counters as one ``EngineState``, read between steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .outputs import EngineState

if TYPE_CHECKING:
    from .engine import LLMEngine


def engine_state(engine: LLMEngine) -> EngineState:
    """The snapshot ``LLMEngine.state`` returns: taken between two steps."""
    bm = engine.block_manager
    sch = engine.scheduler
    return EngineState(
        kv_blocks_total=bm.num_blocks,
        kv_blocks_free=bm.num_free_blocks,
        kv_blocks_cached=bm.num_cached_free_blocks,
        block_size=bm.block_size,
        running=len(sch.running),
        waiting=len(sch.waiting) + len(engine.constraints.pending),
        preemptions=sch.num_preemptions,
        prefix_cache_queries=bm.stats.queries,
        prefix_cache_hits=bm.stats.hits,
        prefix_cache_query_tokens=bm.stats.query_tokens,
        prefill_tokens_saved=bm.stats.hit_tokens,
        prefix_cache_evictions=bm.stats.evictions,
        max_num_seqs=sch.max_num_seqs,
        max_num_batched_tokens=sch.max_num_batched_tokens,
        max_model_len=engine.max_model_len,
        steps=engine.steps,
        generated_tokens=engine.generated_tokens,
        aborted=engine.aborted,
        max_tokens_after_abort=engine.max_tokens_after_abort,
        weight_bytes=_weight_bytes(engine),
        spec_proposed_tokens=engine.spec_stats.proposed,
        spec_accepted_tokens=engine.spec_stats.accepted,
        spec_verify_steps=engine.spec_stats.verified,
        spec_emitted_tokens=engine.spec_stats.emitted,
        spec_draft_seconds=engine.spec_stats.draft_seconds,
        grammar_sequences=engine.constraints.live,
        grammar_compiles=engine.constraints.compiles,
        grammar_cache_hits=engine.constraints.cache_hits,
    )


def _weight_bytes(engine: LLMEngine) -> int:
    """The weights the engine holds: the model's, and the draft model's (0 for a
    runner without a model, as in tests)."""
    total = 0
    for runner in (engine.runner, getattr(engine.proposer, "runner", None)):
        model = getattr(runner, "model", None)
        if model is not None:
            total += int(model.weight_bytes())
    return total
