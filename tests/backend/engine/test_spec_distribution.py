"""Speculative decoding keeps the target's distribution exactly: a chi-square test over
many sampled continuations, through the engine, with a small-vocabulary model and two
drafters (a full draft distribution, and a point mass as the n-gram drafter gives). The
same test rejects the rule with its residual step replaced by plain resampling from p,
so it has the power to see the difference."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from backend.engine import spec
from backend.engine.block_manager import BlockManager
from backend.engine.engine import LLMEngine
from backend.engine.sampling import SamplingParams
from backend.engine.scheduler import ScheduledChunk, Scheduler
from backend.engine.spec import Draft

from .scripted import CharDetok

V = 3  # vocabulary
START = 1  # the prompt: one token
LENGTH = 4  # tokens generated per request: one plain, then 2 drafts and the bonus
N = 8000  # requests per run
_gen = torch.Generator().manual_seed(1234)
TARGET = torch.randn(V, V, generator=_gen) * 1.5  # logits of the next token, by the current
DRAFT = torch.randn(V, V, generator=_gen) * 1.5


class MarkovRunner:
    """The target: next-token logits are TARGET[current token], for every row."""

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        pass

    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        rows = []
        for c in chunks:
            if not c.samples:
                continue
            context = [c.seq.token_ids[c.start], *c.draft] if c.draft else [c.seq.token_ids[-1]]
            rows.extend(TARGET[t] for t in context)
        return torch.stack(rows)


class MarkovDrafter:
    """Draws drafts from softmax(DRAFT[current]) (``point``: always current + 1, a point
    mass, as the n-gram drafter's proposals are)."""

    def __init__(self, point: bool) -> None:
        self.point = point

    def propose(self, chunks: list[ScheduledChunk],
                generators: list[torch.Generator | None]) -> list[Draft]:
        out = []
        for c, g in zip(chunks, generators):
            cur, toks, qs = c.seq.token_ids[-1], [], []
            for _ in range(c.num_spec):
                if self.point:
                    cur = (cur + 1) % V
                else:
                    q = torch.softmax(DRAFT[cur], dim=-1)
                    cur = int(torch.multinomial(q, 1, generator=g).item())
                    qs.append(q)
                toks.append(cur)
            out.append(Draft(toks, torch.stack(qs) if qs else None))
        return out

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        pass

    def after_verify(self, chunk: ScheduledChunk, accepted: int) -> None:
        pass


PLAIN = SamplingParams(max_tokens=LENGTH, temperature=1.0, ignore_eos=True)
# temperature, top-k and a logit bias change p: the verifier must use the p a plain step uses
SHAPED = SamplingParams(max_tokens=LENGTH, temperature=0.7, top_k=2, logit_bias=((0, 0.5),),
                        ignore_eos=True)


def target_probs(params: SamplingParams) -> torch.Tensor:
    """p(next | current) as a plain step samples it: [V, V]."""
    x = TARGET.double().clone()
    for tok, bias in params.logit_bias:
        x[:, tok] += bias
    x = x / params.temperature
    if 0 < params.top_k < V:
        kth = x.topk(params.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    return torch.softmax(x, dim=-1)


def sample_sequences(drafter: MarkovDrafter | None,
                     params: SamplingParams = PLAIN) -> dict[tuple[int, ...], int]:
    scheduler = Scheduler(BlockManager(4096, 4), max_num_seqs=64, max_num_batched_tokens=512,
                          max_model_len=64, clock=time.monotonic,
                          num_spec_tokens=0 if drafter is None else 2, spec_max_batch=64)
    engine = LLMEngine(runner=MarkovRunner(), scheduler=scheduler, vocab_size=V,
                       eos_token_ids=(0,), make_detokenizer=CharDetok,
                       make_salt=lambda s: b"", seed=7, proposer=drafter)
    counts: dict[tuple[int, ...], int] = {}
    out: dict[str, list[int]] = {}
    added = 0
    while added < N or engine.has_work():
        while added < N and len(out) < 64:
            out[str(added)] = []
            engine.add_request(str(added), [START], params)
            added += 1
        for d in engine.step():
            out[d.request_id].extend(d.token_ids)
            if d.finished:
                toks = tuple(out.pop(d.request_id))
                counts[toks] = counts.get(toks, 0) + 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    if drafter is not None:
        st = engine.state()
        assert st.spec_proposed_tokens >= 2 * N
        assert 0 < st.spec_accepted_tokens < st.spec_proposed_tokens
    return counts


def p_value(counts: dict[tuple[int, ...], int], params: SamplingParams = PLAIN) -> float:
    """Chi-square goodness of fit of the counts to the target's exact joint distribution
    (cells the target cannot produce must stay empty)."""
    p = target_probs(params)
    stat, cells = 0.0, 0
    for seq in itertools.product(range(V), repeat=LENGTH):
        prob, cur = 1.0, START
        for t in seq:
            prob *= float(p[cur, t])
            cur = t
        if prob == 0.0:
            assert seq not in counts, seq
            continue
        expected = N * prob
        stat += (counts.get(seq, 0) - expected) ** 2 / expected
        cells += 1
    assert sum(counts.values()) == N
    df = torch.tensor((cells - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, torch.tensor(stat / 2, dtype=torch.float64)))


def test_the_test_accepts_plain_sampling() -> None:
    assert p_value(sample_sequences(None)) > 1e-3


@pytest.mark.parametrize("params", [PLAIN, SHAPED], ids=["t1", "t0.7-topk2-bias"])
@pytest.mark.parametrize("point", [False, True], ids=["draft-distribution", "point-mass"])
def test_speculative_sampling_keeps_the_target_distribution(point: bool,
                                                            params: SamplingParams) -> None:
    assert p_value(sample_sequences(MarkovDrafter(point), params), params) > 1e-3


@pytest.mark.parametrize("point", [False, True], ids=["draft-distribution", "point-mass"])
def test_resampling_from_p_on_rejection_is_caught(point: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spec, "residual", lambda p, q, tok: p)
    assert p_value(sample_sequences(MarkovDrafter(point))) < 1e-6


class WrongDrafter(MarkovDrafter):
    """Proposes a token the greedy target never picks (``right``: the one it picks)."""

    def __init__(self, right: bool) -> None:
        super().__init__(point=True)
        self.right = right

    def propose(self, chunks: list[ScheduledChunk],
                generators: list[torch.Generator | None]) -> list[Draft]:
        out = []
        for c in chunks:
            cur, toks = c.seq.token_ids[-1], []
            for _ in range(c.num_spec):
                best = int(TARGET[cur].argmax())
                cur = best if self.right else (best + 1) % V
                toks.append(cur)
            out.append(Draft(toks))
        return out


@pytest.mark.parametrize("right", [False, True], ids=["always-wrong", "always-right"])
def test_drafting_backs_off_while_nothing_is_accepted(right: bool) -> None:
    def generate(drafter: MarkovDrafter | None) -> tuple[list[int], LLMEngine]:
        scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64,
                              max_model_len=256, clock=time.monotonic, num_spec_tokens=4,
                              spec_max_batch=4)
        engine = LLMEngine(runner=MarkovRunner(), scheduler=scheduler, vocab_size=V,
                           eos_token_ids=(0,), make_detokenizer=CharDetok,
                           make_salt=lambda s: b"", proposer=drafter)
        engine.add_request("r", [START], SamplingParams(max_tokens=200, temperature=0.0,
                                                        ignore_eos=True))
        toks: list[int] = []
        while engine.has_work():
            for d in engine.step():
                toks.extend(d.token_ids)
        assert engine.block_manager.num_free_blocks == 64
        return toks, engine

    plain, _ = generate(None)
    toks, engine = generate(WrongDrafter(right))
    st = engine.state()
    assert toks == plain and len(toks) == 200
    if right:  # every draft accepted: 5 tokens a step, never paused
        assert st.spec_accepted_tokens == st.spec_proposed_tokens and engine.steps <= 45
    else:  # 1 failed step, then 1-token probes after pauses of 8, 16, 32, 64, 64
        assert st.spec_accepted_tokens == 0 and st.spec_verify_steps <= 6
        assert st.spec_proposed_tokens <= 4 + 5
