"""The batched sampler against a straightforward per-row reference: logit bias, presence
and frequency penalties, temperature, top-k, top-p, seeded draws, and raw logprobs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.engine.sampler import make_generator, sample, token_logprobs
from backend.engine.sampling import SamplingParams

VOCAB = 64


def reference_row(row: torch.Tensor, p: SamplingParams, output: list[int],
                  g: torch.Generator | None) -> int:
    """One row on its own, each feature as the docs state it."""
    row = row.clone()
    for tok, bias in p.logit_bias:
        row[tok] += bias
    if p.penalized:
        counts = torch.bincount(torch.tensor(output, dtype=torch.long),
                                minlength=row.numel()).to(row.dtype)
        presence = torch.tensor(p.presence_penalty, dtype=row.dtype)
        frequency = torch.tensor(p.frequency_penalty, dtype=row.dtype)
        row = row - (presence * (counts > 0).to(row.dtype) + frequency * counts)
    if p.greedy:
        return int(row.argmax())
    row = row / p.temperature
    if p.min_p > 0:
        probs = torch.softmax(row, dim=-1)
        row = row.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if 0 < p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, idx = torch.sort(row, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        cum = torch.cumsum(sorted_probs, dim=-1)
        drop = (cum - sorted_probs) >= p.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        row = torch.empty_like(row).scatter_(0, idx, sorted_logits)
    probs = torch.softmax(row, dim=-1)
    u = float(torch.rand((), generator=g))  # one uniform per pick, from the row's generator
    cdf = torch.cumsum(probs, dim=-1)
    target = torch.tensor(u, dtype=torch.float32) * cdf[-1]
    for tok in range(probs.numel()):  # the first token whose cumulative mass passes u
        if cdf[tok] > target:
            return tok
    return int(torch.nonzero(probs).max())


def gens(params: list[SamplingParams]) -> list[torch.Generator | None]:
    return [None if p.greedy else make_generator(p.seed or 0) for p in params]


def logits_of(seed: int, n: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def test_a_bias_of_100_makes_greedy_pick_a_token_and_minus_100_bans_it() -> None:
    logits = logits_of(1, 4)
    best = logits.argmax(dim=-1).tolist()
    target = [(b + 5) % VOCAB for b in best]
    params = [SamplingParams(temperature=0, logit_bias=((t, 100.0),)) for t in target]
    assert sample(logits, params, gens(params)) == target
    banned = [SamplingParams(temperature=0, logit_bias=((b, -100.0),)) for b in best]
    second = logits.topk(2, dim=-1).indices[:, 1].tolist()
    assert sample(logits, banned, gens(banned)) == second
    # sampled rows too: a +100 bias dwarfs the rest of the distribution
    seeded = [SamplingParams(temperature=1.0, seed=i, logit_bias=((t, 100.0),))
              for i, t in enumerate(target)]
    assert sample(logits, seeded, gens(seeded)) == target
    assert torch.equal(logits, logits_of(1, 4))  # the step's logits are left alone


def test_penalties_count_the_output_tokens() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4] = 2.0, 1.5
    plain = [SamplingParams(temperature=0)]
    assert sample(logits, plain, [None], outputs=[[3, 3]]) == [3]  # no penalty asked
    presence = [SamplingParams(temperature=0, presence_penalty=1.0)]
    assert sample(logits, presence, [None], outputs=[[3, 3, 3]]) == [4]  # 2 - 1 < 1.5
    freq = [SamplingParams(temperature=0, frequency_penalty=0.2)]
    assert sample(logits, freq, [None], outputs=[[3, 3]]) == [3]  # 2 - 0.4 > 1.5
    assert sample(logits, freq, [None], outputs=[[3, 3, 3]]) == [4]  # 2 - 0.6 < 1.5
    assert sample(logits, freq, [None], outputs=[[]]) == [3]  # the prompt never counts
    negative = [SamplingParams(temperature=0, presence_penalty=-2.0)]
    assert sample(logits, negative, [None], outputs=[[4]]) == [4]  # 1.5 + 2 > 2


params_st = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.6]),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]),
    top_k=st.sampled_from([0, -1, 1, 5, 40, VOCAB + 3]),
    min_p=st.sampled_from([0.0, 0.0, 0.05, 0.3]),
    seed=st.integers(0, 2**32),
    presence_penalty=st.sampled_from([0.0, 0.5, -1.0, 2.0]),
    frequency_penalty=st.sampled_from([0.0, 0.3, -0.7, 2.0]),
    logit_bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100),
                               max_size=5).map(lambda d: tuple(d.items())),
    logprobs=st.sampled_from([None, 0, 3]),
)


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(st.tuples(params_st, st.lists(st.integers(0, VOCAB - 1), max_size=12)),
                     min_size=1, max_size=6),
       seed=st.integers(0, 2**16), scale=st.sampled_from([0.5, 3.0, 12.0]))
def test_batched_equals_a_per_row_reference(rows, seed: int, scale: float) -> None:
    params = [p for p, _ in rows]
    outputs = [o for _, o in rows]
    logits = logits_of(seed, len(rows), scale)
    expected = [reference_row(logits[i], p, outputs[i], g)
                for i, (p, g) in enumerate(zip(params, gens(params)))]
    assert sample(logits, params, gens(params), outputs=outputs) == expected
    # each row alone gets what it gets in the batch
    for i, p in enumerate(params):
        alone = sample(logits[i:i + 1], [p], gens([p]), outputs=[outputs[i]])
        assert alone == [expected[i]]


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-40, 9.99e-6])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature: float) -> None:
    # Logits divided by 5e-324 overflow to inf and softmax gives NaN: multinomial raised in
    # the engine's step and took the server down (a fuzzed body did). Such rows are greedy,
    # alone (the scalar path), in a block with a random row, and after a logit bias.
    logits = logits_of(7, 3, 12.0)
    tiny = SamplingParams(temperature=temperature, seed=1)
    hot = SamplingParams(temperature=1.0, seed=2)
    assert tiny.greedy
    argmax = logits.argmax(dim=-1).tolist()
    assert sample(logits[:1], [tiny], [make_generator(1)]) == argmax[:1]
    out = sample(logits, [hot, tiny, tiny], [make_generator(2), make_generator(1),
                                            make_generator(1)])
    assert out[1:] == argmax[1:]
    biased = SamplingParams(temperature=temperature, logit_bias=((5, 100.0),))
    assert sample(logits[:1], [biased], [None]) == [5]
    assert not SamplingParams(temperature=1e-5).greedy  # the threshold itself samples


def test_logprobs_are_the_raw_distribution_for_the_rows_that_ask() -> None:
    logits = logits_of(2, 3)
    params = [SamplingParams(temperature=0.5, seed=1, logprobs=4,
                             presence_penalty=2.0, logit_bias=((0, 50.0),)),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0, logprobs=0)]
    tokens = sample(logits, params, gens(params), outputs=[[1, 2], [], []])
    lps = token_logprobs(logits, params, tokens)
    raw = torch.log_softmax(logits, dim=-1)
    assert lps[1] is None
    first, third = lps[0], lps[2]
    assert first is not None and third is not None
    assert first.logprob == raw[0, tokens[0]].item()  # before bias, penalty, temperature
    assert [t for t, _ in first.top] == raw[0].topk(4).indices.tolist()
    assert [v for _, v in first.top] == sorted((v for _, v in first.top), reverse=True)
    assert [v for _, v in first.top] == raw[0].topk(4).values.tolist()
    assert third.top == () and third.logprob == raw[2, tokens[2]].item()
    assert third.logprob == raw[2].max().item()  # greedy picks the most likely


def test_nothing_asked_nothing_computed() -> None:
    logits = logits_of(3, 2)
    params = [SamplingParams(temperature=0), SamplingParams(seed=5)]
    assert token_logprobs(logits, params, [0, 0]) == [None, None]
