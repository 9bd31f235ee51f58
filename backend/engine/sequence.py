"""One request's state as the scheduler and block manager see it (pure Python)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .sampling import SamplingParams

MAX_PREFILL_CHUNKS = 128


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued: never scheduled, or preempted (its KV was dropped)
    RUNNING = "running"  # holds KV blocks; prefilling or decoding
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(slots=True, eq=False)
class Sequence:
    """A request inside the engine.

    Invariants:
    - ``token_ids`` is prompt + generated tokens; ``num_computed_tokens`` of them have
      their K/V in the blocks of ``block_table`` (block i holds tokens
      [i*block_size, (i+1)*block_size)).
    - ``block_hashes[i]`` is the chained hash of full block i, known once its tokens are.
    - A WAITING sequence holds no blocks and has ``num_computed_tokens == 0``.
    - A request with ``params.n`` = k > 1 is one sequence (``index`` 0) until its first
      token, then k sequences of the same ``request_id`` and indexes 0..k-1, forked from
      it after its prefill (``Scheduler.fork``), which share its blocks.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = 0.0
    cache_salt: bytes = b""
    index: int = 0  # the choice this sequence generates (``n`` > 1)
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache on first admission
    num_committed_blocks: int = 0  # leading full blocks registered in the prefix cache
    # leading tokens whose K/V the draft model has in its own cache (spec decoding, draft.py)
    num_draft_computed_tokens: int = 0
    # speculative decoding's recent acceptance (accepted / proposed, smoothed), the steps
    # it sits out after low acceptance, how long the next pause is, and whether the next
    # draft is a one-token probe after a pause (Scheduler.accept)
    spec_acceptance: float = 0.35
    spec_pause: int = 0
    spec_backoff: int = 0
    spec_probe: bool = False
    num_preemptions: int = 0
    # timings (engine clock, seconds)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    # (start position, tokens, step start, step end) of each prefill chunk run, recompute
    # after a preemption included; at most MAX_PREFILL_CHUNKS (for the trace)
    prefill_chunks: list[tuple[int, int, float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def awaits_fork(self) -> bool:
        """A request for several choices that has not forked yet (it holds their slots)."""
        return self.params.n > 1 and self.num_tokens == self.num_prompt_tokens

    @property
    def num_slots(self) -> int:
        """Sequence slots (``max_num_seqs``) this sequence holds or will hold."""
        return self.params.n if self.awaits_fork else 1

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]
