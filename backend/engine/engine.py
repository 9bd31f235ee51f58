"""The synchronous engine core: one step = schedule, run the model, sample, emit deltas.

``LLMEngine`` is owned by a single thread (a ``CoreTransport``'s step loop). Nothing in it
is thread-safe on purpose: requests and aborts reach it between steps.

Its collaborators come in through the constructor: the ``Runner`` (the model), the
``Scheduler`` (with its block manager and the clock), the detokenizer and salt factories, and
an optional step hook that runs just before the model in every step that runs it (fault
injection, ``backend/faults.py``, counts as model time).

A request for ``n`` > 1 choices prefills its prompt once; in the step that computes the
prompt's last token the scheduler forks it into ``n`` sequences sharing its KV blocks, and
each samples its first token from that one row of logits with its own generator. Its
deltas carry their choice's ``index``; a choice's last one has its ``finish_reason``, and
the request's last one (the last choice to end) is ``finished``.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from .errors import InvalidRequestError
from .grammar import GrammarCompiler, LLMatcher
from .grammar_masks import Constraints, MaskJob
from .limits import RequestLimits
from .outputs import EngineState, OutputDelta, RequestMetrics, TokenLogprob, merge_deltas
from .sampler import (
    Argmax,
    choice_seed,
    make_generator,
    pick_tokens,
    token_logprobs,
    torch_argmax,
)
from .sampling import SamplingParams
from .scheduler import ScheduledChunk, Scheduler
from .sequence import FinishReason, Sequence, SequenceStatus
from .snapshot import engine_state
from .spec import Draft, Proposer, SpecStats, verify
from .stop import StopStringMatcher

log = logging.getLogger("sluice.engine")


class Detokenizer(Protocol):
    def add(self, token_ids: list[int]) -> str: ...
    def flush(self) -> str: ...


class Runner(Protocol):
    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor: ...
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None: ...


StepHook = Callable[[], None]


@dataclass(slots=True)
class _ChoiceState:
    """Output-side state of one choice (one sequence) of a live request."""

    detok: Detokenizer
    stopper: StopStringMatcher
    generator: torch.Generator | None
    matcher: LLMatcher | None = None  # its grammar's state (constrained decoding)


@dataclass(slots=True)
class _RequestState:
    """Output-side state of a live request."""

    choices: dict[int, _ChoiceState]  # the choices not finished yet, by index
    num_output_tokens: int = 0  # over all its choices
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
        proposer: Proposer | None = None,
        grammars: GrammarCompiler | None = None,
        batch_sampling: bool = False,
    ) -> None:
        self.runner = runner
        # sample on the device, copying back only the ids (``sampler.pick_tokens``)
        self.batch_sampling = batch_sampling
        # constrained decoding (grammar.py): a matcher per constrained choice, masks
        # computed beside the forward pass; a step without one pays nothing
        self.constraints = Constraints(grammars, vocab_size)
        self.step_hook = step_hook
        # speculative decoding (spec.py): the scheduler reserves draft slots, this drafts
        self.proposer = proposer
        self.spec_stats = SpecStats()
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
        self.refusals: list[tuple[str, InvalidRequestError]] = []  # take_refusals()
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
        if self.constraints.defer(seq):  # its grammar compiles: it waits there
            self._requests[request_id] = _RequestState({})
            return seq
        self._requests[request_id] = _RequestState({0: self._choice_state(seq)})
        self.scheduler.add(seq)
        return seq

    def _admit_compiled(self, wait: bool) -> None:
        """Schedule the requests whose grammar has compiled; refuse those it could not."""
        for seq, got in self.constraints.compiled(wait):
            rid = seq.request_id
            if isinstance(got, InvalidRequestError):
                del self._requests[rid]
                self.refusals.append((rid, got))
            else:
                self._requests[rid].choices[0] = self._choice_state(seq, got.template)
                self.scheduler.add(seq)

    @property
    def grammars(self) -> GrammarCompiler | None:
        """The engine's grammar compiler (None: no constrained decoding)."""
        return self.constraints.grammars

    def take_refusals(self) -> list[tuple[str, InvalidRequestError]]:
        """Requests refused after ``add_request`` returned (their grammar failed)."""
        out, self.refusals = self.refusals, []
        return out

    def _choice_state(self, seq: Sequence, source: LLMatcher | None = None) -> _ChoiceState:
        """A new choice's output state (``source``: the matcher its own copies, that of
        the choice it forks from or a compiled template)."""
        params = seq.params
        matcher = None if params.grammar is None else self.constraints.matcher(
            params.grammar, source)
        generator = None
        if not params.greedy:
            if params.seed is not None:
                generator = make_generator(choice_seed(params.seed, seq.index))
            else:
                self._num_unseeded += 1
                generator = make_generator(self.seed * 1_000_003 + self._num_unseeded)
        return _ChoiceState(self.make_detokenizer(seq.prompt_token_ids),
                            StopStringMatcher(params.stop), generator, matcher)

    def mark_abort(self, request_id: str, *, at: float | None = None) -> None:
        """Note how far a request had got when its abort was asked for (any thread).
        ``at``: when it was asked, on this engine's clock, by an asker in another process
        whose message arrives later: the mark counts the tokens made until then."""
        state = self._requests.get(request_id)
        group = self.scheduler.group(request_id)
        if state is not None and group and state.abort_mark is None:
            if at is None:
                state.abort_mark, state.abort_time = state.num_output_tokens, self.clock()
            else:
                later = sum(len(s.token_times) - bisect.bisect_right(s.token_times, at)
                            for s in group)
                state.abort_mark, state.abort_time = state.num_output_tokens - later, at

    def abort(self, request_id: str) -> OutputDelta | None:
        """Abort from any state (every choice); frees the blocks now. Unknown/finished ids:
        no-op."""
        state = self._requests.get(request_id)
        seq = self.constraints.drop(request_id)  # still compiling its grammar
        if seq is not None:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.ABORT
        else:
            seq = self.scheduler.abort(request_id)
        if seq is None or state is None:
            return None
        self.aborted += 1
        mark = state.abort_mark if state.abort_mark is not None else state.num_output_tokens
        after = state.num_output_tokens - mark
        self.max_tokens_after_abort = max(self.max_tokens_after_abort, after)
        seq.finished_time = self.clock()
        self.constraints.release(sum(c.matcher is not None for c in state.choices.values()))
        state.choices.clear()
        return self._final_delta(seq, "", (), (), tokens_after_abort=after,
                                 abort_time=state.abort_time)

    def abort_all(self) -> list[OutputDelta]:
        """Abort every running and waiting request (shutdown); their final deltas."""
        sch = self.scheduler
        pending = [s for s, _ in self.constraints.pending.values()]
        deltas = [self.abort(s.request_id) for s in sch.running + sch.waiting + pending]
        return [d for d in deltas if d is not None]

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.constraints.pending)

    def close(self) -> None:
        """Stop the grammar worker threads (after the last step)."""
        self.constraints.close()

    # ---- one iteration ----------------------------------------------------------------
    def step(self) -> list[OutputDelta]:
        if self.constraints.pending:
            self._admit_compiled(wait=not self.scheduler.has_work())
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        started = self.clock()
        if self.step_hook is not None:  # counted as model time (a slow model, in faults.py)
            self.step_hook()
        if out.copies:  # copy on write of forked blocks, before the model writes into them
            self.runner.copy_blocks(out.copies)
            if self.proposer is not None:
                self.proposer.copy_blocks(out.copies)
        drafts = self._propose(out.chunks)
        masks = self._start_masks(out.chunks) if self.constraints.live else None
        logits = self.runner.execute(out.chunks)  # on the model's device
        if masks is not None or drafts or not self.batch_sampling:
            logits = logits.cpu()
        raw = None  # logprobs read the model's logits, before any mask (as without one)
        if masks is not None:
            if masks.wants_raw:
                raw = logits.clone()
            logits = masks.apply(logits)
        now = self.clock()
        self.steps += 1
        self.scheduler.on_step_done(out, started, now)
        chunks = [c for c in out.chunks if c.samples]
        if not drafts:
            deltas = self._sample([c.seq for c in chunks], logits, now, raw)
        else:  # rows: one per plain chunk, 1 + m per chunk with m drafts
            plain: list[int] = []
            spec: list[tuple[ScheduledChunk, int]] = []
            row = 0
            for c in chunks:
                if c.draft:
                    spec.append((c, row))
                else:
                    plain.append(row)
                row += 1 + len(c.draft)
            deltas = self._sample([c.seq for c in chunks if not c.draft],
                                  logits[plain], now,
                                  None if raw is None else raw[plain]) if plain else []
            deltas += self._verify(spec, drafts, logits, now)
        for c in out.chunks:
            if c.num_spec and not c.draft:  # reserved, but nothing was drafted
                self.scheduler.accept(c.seq, 0, 0)
        return deltas

    def _start_masks(self, chunks: list[ScheduledChunk]) -> MaskJob | None:
        """Start the masks of the step's constrained rows (a worker computes them while
        the model runs); None when no row is constrained. A constrained chunk never has
        drafts (``Scheduler._num_spec``), so its row is one row of the logits."""
        work: list[tuple[LLMatcher, int]] = []
        wants_raw = False
        row = 0
        for c in chunks:
            if not c.samples:
                continue
            state = self._requests.get(c.seq.request_id)
            choice = state.choices.get(c.seq.index) if state is not None else None
            if choice is not None and choice.matcher is not None:
                work.append((choice.matcher, row))
                wants_raw = wants_raw or c.seq.params.logprobs is not None
            row += 1 + len(c.draft)
        return self.constraints.start(work, wants_raw)

    def _sample(self, sampling: list[Sequence], logits: torch.Tensor, now: float,
                raw: torch.Tensor | None = None) -> list[OutputDelta]:
        """One token for each sequence, from its row of ``logits`` (``raw``: the same
        rows before the grammars' masks, for logprobs)."""
        if any(s.awaits_fork for s in sampling):
            rows = self._fork(sampling)
            sampling = [s for s, _ in rows]
            index = torch.tensor([r for _, r in rows], dtype=torch.long)
            logits = logits.index_select(0, index.to(logits.device, non_blocking=True))
            raw = None if raw is None else raw.index_select(0, index)
        params = [s.params for s in sampling]
        gens = [self._generator(s) for s in sampling]
        outputs = [s.output_token_ids if s.params.penalized else () for s in sampling]
        tokens, lps = pick_tokens(logits, params, gens, self._argmax, outputs, raw,
                                  self.batch_sampling)
        return [self._append_token(seq, tok, now, lp)
                for seq, tok, lp in zip(sampling, tokens, lps)]

    def _propose(self, chunks: list[ScheduledChunk]) -> dict[int, Draft]:
        """Drafts for the chunks the scheduler reserved draft slots for, by chunk id; each
        such chunk's ``draft`` is set."""
        reserved = [c for c in chunks if c.num_spec]
        if not reserved or self.proposer is None:
            return {}
        began = self.clock()
        found = self.proposer.propose(reserved, [self._generator(c.seq) for c in reserved])
        self.spec_stats.draft_seconds += self.clock() - began
        drafts: dict[int, Draft] = {}
        for c, d in zip(reserved, found):
            c.draft = d.tokens[:c.num_spec]
            if c.draft:
                probs = None if d.probs is None else d.probs[:len(c.draft)]
                drafts[id(c)] = Draft(c.draft, probs)
        return drafts

    def _verify(self, spec: list[tuple[ScheduledChunk, int]], drafts: dict[int, Draft],
                logits: torch.Tensor, now: float) -> list[OutputDelta]:
        """Accept each chunk's drafts by the exact rule (``spec.verify``) and emit the
        tokens: one delta per sequence for all the tokens its step produced."""
        rows = [r for c, start in spec for r in range(start, start + 1 + len(c.draft))]
        x = logits[rows]
        seqs = [c.seq for c, _ in spec]
        params = [s.params for s in seqs]
        results = verify(x, [drafts[id(c)] for c, _ in spec], params,
                         [self._generator(s) for s in seqs], self._argmax)
        stats = self.spec_stats
        deltas: list[OutputDelta] = []
        at = 0
        for (c, _), (toks, accepted), p in zip(spec, results, params):
            # each emitted token's logprobs come from its own row (rows 0..accepted)
            lps = token_logprobs(x[at:at + len(toks)], [p] * len(toks), toks)
            at += 1 + len(c.draft)
            seq = c.seq
            mine: list[OutputDelta] = []
            for tok, lp in zip(toks, lps):
                mine.append(self._append_token(seq, tok, now, lp))
                if seq.status is SequenceStatus.FINISHED:
                    break
            stats.proposed += len(c.draft)
            stats.accepted += min(accepted, len(mine))  # not the ones after a stop
            stats.verified += 1
            stats.emitted += len(mine)
            deltas.append(merge_deltas(mine))
            if self.proposer is not None:
                self.proposer.after_verify(c, accepted)
            self.scheduler.accept(seq, accepted, len(c.draft))
        return deltas

    def _fork(self, sampling: list[Sequence]) -> list[tuple[Sequence, int]]:
        """Fork the requests whose prompt was just computed into their ``n`` choices; the
        sampling sequences with their row of the logits (each child's its parent's)."""
        out: list[tuple[Sequence, int]] = []
        for row, seq in enumerate(sampling):
            out.append((seq, row))
            if seq.awaits_fork:
                state = self._requests[seq.request_id]
                parent = state.choices[seq.index].matcher
                for child in self.scheduler.fork(seq):
                    state.choices[child.index] = self._choice_state(child, parent)
                    out.append((child, row))
        return out

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        state = self._requests.get(seq.request_id)
        choice = state.choices.get(seq.index) if state is not None else None
        return choice.generator if choice is not None else None

    def _append_token(self, seq: Sequence, tok: int, now: float,
                      lp: TokenLogprob | None = None) -> OutputDelta:
        seq.token_ids.append(tok)
        self.generated_tokens += 1
        seq.token_times.append(now)
        if seq.first_token_time is None:
            seq.first_token_time = now
        state = self._requests[seq.request_id]
        state.num_output_tokens += 1
        choice = state.choices[seq.index]
        p = seq.params
        reason: FinishReason | None = None
        text = ""
        matched = False
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            reason = FinishReason.STOP  # the stop token itself is not part of the text
        else:
            if choice.matcher is not None and not choice.matcher.consume_token(tok):
                # cannot happen: the token was sampled under this matcher's mask
                log.error("request %s: its grammar refused token %d: %s", seq.request_id,
                          tok, choice.matcher.get_error())
                reason = FinishReason.STOP
            text, matched = choice.stopper.feed(choice.detok.add([tok]))
            if matched or (choice.matcher is not None and choice.matcher.is_stopped()):
                reason = FinishReason.STOP  # a complete grammar allows nothing more
        if reason is None:
            reason = self.scheduler.check_length(seq)
        if reason is None:
            return OutputDelta(
                request_id=seq.request_id, text=text, token_ids=(tok,), token_times=(now,),
                finished=False, finish_reason=None, num_prompt_tokens=seq.num_prompt_tokens,
                num_cached_tokens=seq.num_cached_tokens,
                num_output_tokens=state.num_output_tokens,
                logprobs=None if lp is None else (lp,), index=seq.index)
        if not matched:  # release what was held back: an unfinished character, a partial stop
            tail, matched = choice.stopper.feed(choice.detok.flush())
            text += tail if matched else tail + choice.stopper.flush()
        seq.finish_reason = reason
        seq.finished_time = now
        if choice.matcher is not None:
            self.constraints.release()
        del state.choices[seq.index]
        delta = self._final_delta(seq, text, (tok,), (now,),
                                  logprobs=None if lp is None else (lp,))
        self.scheduler.finish(seq, reason)
        return delta

    def _final_delta(self, seq: Sequence, text: str, token_ids: tuple[int, ...],
                     token_times: tuple[float, ...],
                     tokens_after_abort: int | None = None,
                     abort_time: float | None = None,
                     logprobs: tuple[TokenLogprob, ...] | None = None) -> OutputDelta:
        """The last delta of ``seq``'s choice (its ``choices`` entry already dropped); the
        request's last (``finished``, with metrics) if no other choice is left."""
        state = self._requests[seq.request_id]
        reason = seq.finish_reason.value if seq.finish_reason else None
        if state.choices:
            return OutputDelta(
                request_id=seq.request_id, text=text, token_ids=token_ids,
                token_times=token_times, finished=False, finish_reason=reason,
                num_prompt_tokens=seq.num_prompt_tokens,
                num_cached_tokens=seq.num_cached_tokens,
                num_output_tokens=state.num_output_tokens, logprobs=logprobs,
                index=seq.index)
        del self._requests[seq.request_id]
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
        return OutputDelta(
            request_id=seq.request_id, text=text, token_ids=token_ids,
            token_times=token_times, finished=True, finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=state.num_output_tokens, metrics=metrics, logprobs=logprobs,
            index=seq.index)

    # ---- introspection ----------------------------------------------------------------
    def state(self) -> EngineState:
        return engine_state(self)

    def status_of(self, request_id: str) -> SequenceStatus | None:
        seq = self.scheduler.get(request_id)
        return seq.status if seq is not None else None
