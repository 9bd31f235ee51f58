"""Token sampling, batched over the step: one set of tensor ops over the [N, vocab] logits.

Order per step, each stage one batched op over the rows that use it (none: skipped, and
the logits are not copied):

1. ``logit_bias``: a sparse add of every (row, token, bias) of the step;
2. presence / frequency penalties (OpenAI's): ``logit[t] -= presence * (count[t] > 0) +
   frequency * count[t]``, ``count`` over the row's *output* tokens (as OpenAI and vLLM);
3. greedy rows take the argmax (the model runner's native one where it has it);
4. the random rows, ``BLOCK_ROWS`` at a time: divided by their temperature, masked by
   top-k (one ``topk`` at the largest k, each row's k-th value) and top-p (one sort of
   those rows), softmaxed;
5. each random row draws from its own ``torch.Generator`` (``multinomial``), seeded from
   the request's ``seed`` or from the engine's seed and a counter.

Everything before the draw works row by row inside batched ops (each row's values depend
on that row alone), and the draw is per request, so a request's tokens do not depend on what
else shares its batch. ``token_logprobs`` reads the *raw* logits (vLLM's default), not the
distribution after steps 1-4.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from .outputs import TokenLogprob
from .sampling import SamplingParams

Argmax = Callable[[torch.Tensor], list[int]]
NEG_INF = float("-inf")
# Random rows go through temperature/top-k/top-p/softmax/draw this many at a time: a block
# of 32k-vocabulary rows stays in L2 through the ~10 ops, where the whole [32, 32000] batch
# streamed 4 MiB through each of them and was ~1.4x slower than a row at a time; a block
# of one row takes Python scalars for its parameters (``_probs_row``), ~0.1 ms less than
# the tensor path. Seeded rows, this / the old per-row sampler, batch 1, 8, 32: 1.03,
# 1.05, 0.98 (OMP_NUM_THREADS=1 python -m backend.bench.sampler, docs/engine.md).
BLOCK_ROWS = 2


# Choice i > 0 of a seeded request draws from seed + i * this (mod 2**64): odd, so the n
# generators' seeds differ, and choice 0 draws exactly what the same request with n = 1
# would (the golden ratio's 64-bit fraction, as splitmix64 steps).
CHOICE_SEED_STEP = 0x9E37_79B9_7F4A_7C15


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded with ``seed``."""
    return (seed + index * CHOICE_SEED_STEP) & 0xFFFF_FFFF_FFFF_FFFF


def torch_argmax(logits: torch.Tensor) -> list[int]:
    """The first index of each row's largest value (NaN counts as largest)."""
    return logits.argmax(dim=-1).tolist()


def make_generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    argmax: Argmax = torch_argmax,
    outputs: Sequence[Sequence[int]] | None = None,
) -> list[int]:
    """Pick one token per row of ``logits`` ([N, vocab], float32 on the CPU; not modified).

    ``argmax``: the first index of each row's largest value, as a list (the model runner's
    native one where it has it). ``outputs``: each row's output tokens so far, read for the
    rows with penalties (the others may give an empty sequence)."""
    if not params:  # a step of prefill chunks only
        return []
    x = adjusted_logits(logits, params, outputs)
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if len(greedy_rows) == len(params):
        return argmax(x)
    out = [0] * len(params)
    if greedy_rows:
        for i, tok in zip(greedy_rows, argmax(x[greedy_rows])):
            out[i] = tok
        rows = [i for i, p in enumerate(params) if not p.greedy]
        x = x[rows]
    else:
        rows = list(range(len(params)))
    for start in range(0, len(rows), BLOCK_ROWS):
        block = rows[start:start + BLOCK_ROWS]
        probs = probabilities(x[start:start + BLOCK_ROWS], [params[i] for i in block])
        for j, i in enumerate(block):
            out[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]).item())
    return out


def adjusted_logits(logits: torch.Tensor, params: list[SamplingParams],
              outputs: Sequence[Sequence[int]] | None) -> torch.Tensor:
    """``logits`` with the logit bias and penalties applied (a copy; itself when no row
    has either)."""
    bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
    pen_rows = [i for i, p in enumerate(params) if p.penalized]
    if not bias_rows and not pen_rows:
        return logits
    x = logits.clone()
    if bias_rows:
        r = [i for i in bias_rows for _ in params[i].logit_bias]
        t = [tok for i in bias_rows for tok, _ in params[i].logit_bias]
        b = [bias for i in bias_rows for _, bias in params[i].logit_bias]
        # token ids are unique per row (SamplingParams), so this adds each bias once
        x.index_put_((torch.tensor(r), torch.tensor(t)), torch.tensor(b, dtype=x.dtype),
                     accumulate=True)
    if pen_rows:
        if outputs is None:
            raise ValueError("penalties need each row's output tokens")
        seqs = [outputs[i] for i in pen_rows]
        counts = torch.zeros(len(pen_rows), x.shape[1], dtype=x.dtype)
        lengths = torch.tensor([len(s) for s in seqs])
        if int(lengths.sum()):
            where = torch.repeat_interleave(torch.arange(len(pen_rows)), lengths)
            toks = torch.tensor(list(itertools.chain.from_iterable(seqs)))
            counts.index_put_((where, toks), torch.ones(len(toks), dtype=x.dtype),
                              accumulate=True)
        presence = torch.tensor([params[i].presence_penalty for i in pen_rows],
                                dtype=x.dtype)[:, None]
        frequency = torch.tensor([params[i].frequency_penalty for i in pen_rows],
                                 dtype=x.dtype)[:, None]
        idx = torch.tensor(pen_rows)
        penalty = presence * (counts > 0).to(x.dtype) + frequency * counts
        x.index_copy_(0, idx, x.index_select(0, idx) - penalty)
    return x


def probabilities(x: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
    """Softmax of the rows of ``x`` after temperature, top-k and top-p ([M, vocab])."""
    if len(ps) == 1:  # the same values with scalars: ~0.1 ms less than the tensor path
        return _probs_row(x[0], ps[0])[None]
    vocab = x.shape[1]
    x = x / torch.tensor([p.temperature for p in ps], dtype=x.dtype)[:, None]
    k_rows = [j for j, p in enumerate(ps) if 0 < p.top_k < vocab]
    if k_rows:
        ks = [ps[j].top_k for j in k_rows]
        sub = x if len(k_rows) == len(ps) else x[k_rows]
        top = torch.topk(sub, max(ks), dim=-1).values
        kth = top.gather(1, torch.tensor(ks)[:, None] - 1)
        sub = sub.masked_fill(sub < kth, NEG_INF)
        x = _put_rows(x, k_rows, sub)
    p_rows = [j for j, p in enumerate(ps) if p.top_p < 1.0]
    if p_rows:
        sub = x if len(p_rows) == len(ps) else x[p_rows]
        top_p = torch.tensor([ps[j].top_p for j in p_rows], dtype=x.dtype)[:, None]
        sorted_logits, idx = torch.sort(sub, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        cum = torch.cumsum(sorted_probs, dim=-1)
        drop = (cum - sorted_probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
        x = _put_rows(x, p_rows, torch.empty_like(sub).scatter_(1, idx, sorted_logits))
    return torch.softmax(x, dim=-1)


def _probs_row(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """``probabilities`` of one row, with Python scalars for its parameters."""
    row = row / p.temperature
    if 0 < p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, NEG_INF)
    if p.top_p < 1.0:
        sorted_logits, idx = torch.sort(row, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        cum = torch.cumsum(sorted_probs, dim=-1)
        drop = (cum - sorted_probs) >= p.top_p
        sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
        row = torch.empty_like(row).scatter_(0, idx, sorted_logits)
    return torch.softmax(row, dim=-1)


def _put_rows(x: torch.Tensor, rows: list[int], sub: torch.Tensor) -> torch.Tensor:
    """``x`` (a tensor of ``probabilities``' own) with ``rows`` replaced by ``sub`` (``sub``
    itself when it is every row)."""
    if len(rows) == x.shape[0]:
        return sub
    x[rows] = sub
    return x


def token_logprobs(logits: torch.Tensor, params: list[SamplingParams],
                   tokens: list[int]) -> list[TokenLogprob | None]:
    """Per row, the sampled token's logprob and the top ones, for the rows whose params ask
    (``logprobs`` not None; the others get None): one ``log_softmax`` and one ``topk`` over
    those rows of the raw logits."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(params)
    if not rows:
        return out
    lp = torch.log_softmax(logits if len(rows) == len(params) else logits[rows], dim=-1)
    chosen = lp.gather(1, torch.tensor([tokens[i] for i in rows])[:, None])[:, 0].tolist()
    ks = [min(params[i].logprobs or 0, lp.shape[1]) for i in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    top_lps: list[list[float]] = [[] for _ in rows]
    if max(ks):
        values, ids = torch.topk(lp, max(ks), dim=-1)  # sorted, most likely first
        top_ids, top_lps = ids.tolist(), values.tolist()
    for j, i in enumerate(rows):
        k = ks[j]
        out[i] = TokenLogprob(chosen[j], tuple(zip(top_ids[j][:k], top_lps[j][:k])))
    return out
