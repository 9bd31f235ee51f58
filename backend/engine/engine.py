"""The synchronous engine core: one step = schedule, run the model, sample, emit deltas.

``LLMEngine`` is owned by a single thread (a ``CoreTransport``'s step loop). Nothing in it
is thread-safe on purpose: requests and aborts reach it between steps.

Its collaborators come in through the constructor: the ``Runner`` (the model), the
``Scheduler`` (with its block manager and the clock), the detokenizer and salt factories, and
an optional step hook that runs just before the model in every step that runs it (fault
injection, ``backend/faults.py``, counts as model time).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from .errors import InvalidRequestError
from .limits import RequestLimits
from .outputs import EngineState, OutputDelta, RequestMetrics
from .sampler import Argmax, make_generator, sample, torch_argmax
from .sampling import SamplingParams
from .scheduler import ScheduledChunk, Scheduler
from .sequence import FinishReason, Sequence, SequenceStatus
from .stop import StopStringMatcher


class Detokenizer(Protocol):
    def add(self, token_ids: list[int]) -> str: ...
    def flush(self) -> str: ...


class Runner(Protocol):
    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor: ...


StepHook = Callable[[], None]


@dataclass(slots=True)
class _RequestState:
    """Output-side state of a live request."""

    detok: Detokenizer
    stopper: StopStringMatcher
    generator: torch.Generator | None
    abort_mark: int | None = None  # output tokens when abort() was called
    abort_time: float | None = None  # engine clock when abort() was called


class LLMEngine:
    def __init__(
        self,
        *,
        runner: Runner,
        scheduler: Scheduler,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        make_detokenizer: Callable[[list[int]], Detokenizer],
        make_salt: Callable[[str | None], bytes],
        seed: int = 0,
        step_hook: StepHook | None = None,
    ) -> None:
        self.runner = runner
        self.step_hook = step_hook
        # the runner's native argmax for greedy rows, where it has one
        self._argmax: Argmax = getattr(runner, "argmax", None) or torch_argmax
        self.scheduler = scheduler
        self.block_manager = scheduler.bm
        self.limits = RequestLimits(vocab_size, scheduler.max_model_len)
        self.vocab_size = vocab_size
        self.max_model_len = scheduler.max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.make_detokenizer = make_detokenizer
        self.make_salt = make_salt
        self.seed = seed
        self.clock = scheduler.clock  # one clock for the scheduler's stamps and ours
        self._requests: dict[str, _RequestState] = {}
        self._num_unseeded = 0
        self.steps = 0
        self.generated_tokens = 0
        self.aborted = 0
        self.max_tokens_after_abort = 0

    # ---- requests ---------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``InvalidRequestError`` for a request that can never be served."""
        self.limits.validate(prompt_token_ids, params)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> Sequence:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", "request_id")
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running",
                                      "request_id")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError("priority must be an integer", "priority")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError("cache_salt must be a string", "cache_salt")
        self.validate(prompt_token_ids, params)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            priority=priority,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            cache_salt=self.make_salt(cache_salt),
        )
        generator = None
        if not params.greedy:
            if params.seed is not None:
                generator = make_generator(params.seed)
            else:
                self._num_unseeded += 1
                generator = make_generator(self.seed * 1_000_003 + self._num_unseeded)
        self._requests[request_id] = _RequestState(
            detok=self.make_detokenizer(seq.prompt_token_ids),
            stopper=StopStringMatcher(params.stop),
            generator=generator,
        )
        self.scheduler.add(seq)
        return seq

    def mark_abort(self, request_id: str, *, at: float | None = None) -> None:
        """Note how far a request had got when its abort was asked for (any thread).
        ``at``: when it was asked, on this engine's clock, by an asker in another process
        whose message arrives later: the mark counts the tokens made until then."""
        state = self._requests.get(request_id)
        seq = self.scheduler.get(request_id)
        if state is not None and seq is not None and state.abort_mark is None:
            if at is None:
                state.abort_mark, state.abort_time = seq.num_output_tokens, self.clock()
            else:
                state.abort_mark, state.abort_time = bisect.bisect_right(seq.token_times, at), at

    def abort(self, request_id: str) -> OutputDelta | None:
        """Abort from any state; frees the blocks now. Unknown/finished ids: no-op."""
        state = self._requests.get(request_id)
        seq = self.scheduler.abort(request_id)
        if seq is None or state is None:
            return None
        self.aborted += 1
        mark = state.abort_mark if state.abort_mark is not None else seq.num_output_tokens
        after = seq.num_output_tokens - mark
        self.max_tokens_after_abort = max(self.max_tokens_after_abort, after)
        seq.finished_time = self.clock()
        return self._final_delta(seq, "", (), (), tokens_after_abort=after,
                                 abort_time=state.abort_time)

    def abort_all(self) -> list[OutputDelta]:
        """Abort every running and waiting request (shutdown); their final deltas."""
        sch = self.scheduler
        deltas = [self.abort(s.request_id) for s in sch.running + sch.waiting]
        return [d for d in deltas if d is not None]

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- one iteration ----------------------------------------------------------------
    def step(self) -> list[OutputDelta]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        started = self.clock()
        if self.step_hook is not None:  # counted as model time (a slow model, in faults.py)
            self.step_hook()
        logits = self.runner.execute(out.chunks)
        now = self.clock()
        self.steps += 1
        self.scheduler.on_step_done(out, started, now)
        sampling = [c.seq for c in out.chunks if c.samples]
        params = [s.params for s in sampling]
        gens = [self._generator(s) for s in sampling]
        tokens = sample(logits, params, gens, self._argmax)
        return [self._append_token(seq, tok, now) for seq, tok in zip(sampling, tokens)]

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        state = self._requests.get(seq.request_id)
        return state.generator if state is not None else None

    def _append_token(self, seq: Sequence, tok: int, now: float) -> OutputDelta:
        seq.token_ids.append(tok)
        self.generated_tokens += 1
        seq.token_times.append(now)
        if seq.first_token_time is None:
            seq.first_token_time = now
        state = self._requests[seq.request_id]
        p = seq.params
        reason: FinishReason | None = None
        text = ""
        matched = False
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            reason = FinishReason.STOP  # the stop token itself is not part of the text
        else:
            text, matched = state.stopper.feed(state.detok.add([tok]))
            if matched:
                reason = FinishReason.STOP
        if reason is None:
            reason = self.scheduler.check_length(seq)
        if reason is None:
            return OutputDelta(
                request_id=seq.request_id, text=text, token_ids=(tok,), token_times=(now,),
                finished=False, finish_reason=None, num_prompt_tokens=seq.num_prompt_tokens,
                num_cached_tokens=seq.num_cached_tokens,
                num_output_tokens=seq.num_output_tokens)
        if not matched:  # release what was held back: an unfinished character, a partial stop
            tail, matched = state.stopper.feed(state.detok.flush())
            text += tail if matched else tail + state.stopper.flush()
        seq.finish_reason = reason
        seq.finished_time = now
        delta = self._final_delta(seq, text, (tok,), (now,))
        self.scheduler.finish(seq, reason)
        return delta

    def _final_delta(self, seq: Sequence, text: str, token_ids: tuple[int, ...],
                     token_times: tuple[float, ...],
                     tokens_after_abort: int | None = None,
                     abort_time: float | None = None) -> OutputDelta:
        self._requests.pop(seq.request_id, None)
        metrics = RequestMetrics(
            arrival_time=seq.arrival_time,
            first_scheduled_time=seq.first_scheduled_time,
            first_token_time=seq.first_token_time,
            finished_time=seq.finished_time,
            token_times=tuple(seq.token_times),
            num_preemptions=seq.num_preemptions,
            tokens_after_abort=tokens_after_abort,
            prefill_chunks=tuple(seq.prefill_chunks),
            abort_time=abort_time,
        )
        reason = seq.finish_reason.value if seq.finish_reason else None
        return OutputDelta(
            request_id=seq.request_id, text=text, token_ids=token_ids,
            token_times=token_times, finished=True, finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens, metrics=metrics)

    # ---- introspection ----------------------------------------------------------------
    def state(self) -> EngineState:
        bm = self.block_manager
        sch = self.scheduler
        return EngineState(
            kv_blocks_total=bm.num_blocks,
            kv_blocks_free=bm.num_free_blocks,
            kv_blocks_cached=bm.num_cached_free_blocks,
            block_size=bm.block_size,
            running=len(sch.running),
            waiting=len(sch.waiting),
            preemptions=sch.num_preemptions,
            prefix_cache_queries=bm.stats.queries,
            prefix_cache_hits=bm.stats.hits,
            prefix_cache_query_tokens=bm.stats.query_tokens,
            prefill_tokens_saved=bm.stats.hit_tokens,
            prefix_cache_evictions=bm.stats.evictions,
            max_num_seqs=sch.max_num_seqs,
            max_num_batched_tokens=sch.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            steps=self.steps,
            generated_tokens=self.generated_tokens,
            aborted=self.aborted,
            max_tokens_after_abort=self.max_tokens_after_abort,
        )

    def status_of(self, request_id: str) -> SequenceStatus | None:
        seq = self.scheduler.get(request_id)
        return seq.status if seq is not None else None
