"""Token sampling, batched over the step: one set of tensor ops over the [N, vocab] logits.

Order per step, each stage one batched op over the rows that use it (none: skipped, and
the logits are not copied):

1. ``logit_bias``: a sparse add of every (row, token, bias) of the step;
2. presence / frequency penalties (OpenAI's): ``logit[t] -= presence * (count[t] > 0) +
   frequency * count[t]``, ``count`` over the row's *output* tokens (as OpenAI and vLLM);
3. greedy rows take the argmax (the model runner's native one where it has it);
4. the random rows, ``BLOCK_ROWS`` at a time: divided by their temperature, masked by
   min-p (below ``min_p`` times the likeliest token's probability), top-k (one ``topk`` at
   the largest k, each row's k-th value) and top-p (one stable sort of those rows),
   softmaxed;
5. each random row takes one uniform number from its own ``torch.Generator`` (seeded from
   the request's ``seed`` or from the engine's seed and a counter) and picks by inverse
   CDF (``draw``): the first token whose cumulative probability passes it.

Everything before the draw works row by row inside batched ops (each row's values depend
on that row alone), and the draw is per request, so a request's tokens do not depend on what
else shares its batch. ``token_logprobs`` reads the *raw* logits (vLLM's default), not the
distribution after steps 1-4.

``sample`` is the host sampler (CPU logits, tokens as a list; what the CPU engine runs).
``sample_batch`` is the same computation over every row at once on the logits' device,
returning the picks as a device tensor: the engine's step on a GPU copies only those ids to
the host. Both take their uniforms from the same generators in the same order, so they
pick the same tokens (``tests/backend/engine/test_batch_sampler.py``).
"""

from __future__ import annotations

import itertools
import math
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
        for i, tok in zip(block, draw(probs, uniforms([generators[i] for i in block])).tolist()):
            out[i] = tok
    return out


def pick_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    argmax: Argmax,
    outputs: Sequence[Sequence[int]],
    raw: torch.Tensor | None,
    on_device: bool,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """The step's tokens and their logprobs (``raw``: the logits before grammar masks).
    ``on_device`` and no row asking for logprobs: ``sample_batch`` where the logits are,
    the picked ids the step's one copy back to the host; else ``sample`` on host logits
    (the CPU engine's, tuned for its caches)."""
    if not params:  # a step of prefill chunks only
        return [], []
    if on_device and raw is None and all(p.logprobs is None for p in params):
        picks: list[int] = sample_batch(logits, params, generators, outputs).tolist()
        return picks, [None] * len(picks)
    logits = logits.cpu()
    tokens = sample(logits, params, generators, argmax, outputs)
    return tokens, token_logprobs(logits if raw is None else raw, params, tokens)


def sample_batch(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    outputs: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """``sample`` over every row at once, on ``logits``' device: the picks as an [N] int64
    tensor there. Nothing is read back from the device: the parameters, uniforms and
    penalty counts go to it (host-to-device copies), and the caller copies the ids back,
    once. Greedy rows take torch's argmax."""
    dev = logits.device
    if not params:  # a step of prefill chunks only
        return torch.empty(0, dtype=torch.long, device=dev)
    x = adjusted_logits(logits, params, outputs)
    ids = x.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return ids
    u = uniforms([generators[i] for i in rows]).to(dev, non_blocking=True)
    if len(rows) == len(params):
        return draw(probabilities(x, params), u)
    index = _on(rows, torch.long, dev)
    picked = draw(probabilities(x.index_select(0, index), [params[i] for i in rows]), u)
    return ids.index_copy_(0, index, picked)


def uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """The next number in [0, 1) of each row's generator (torch's default one for None),
    as a float32 CPU tensor [M] (no Python floats: nothing is read out of a tensor)."""
    return torch.stack([torch.rand((), generator=g) for g in generators])


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF picks: per row of ``probs`` ([M, vocab], unnormalised is fine), the
    first token whose cumulative probability exceeds ``u`` ([M], in [0, 1)) times the
    row's total. An exact draw from the row's distribution for a uniform ``u``.

    Never a token of probability 0: rounding at the top end picks the last token that has
    some, and where a parallel scan (CUDA's ``cumsum``) lets the sum rise across a token of
    probability 0, that token gives way to the last one with mass. A row with NaN picks a
    token in range (the last), never one past the vocabulary: an id out of range would
    fail the next step's embedding on a GPU."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    last = torch.searchsorted(cdf, total).clamp_(max=probs.shape[1] - 1)  # the last with mass
    picks = torch.minimum(torch.searchsorted(cdf, u[:, None] * total, right=True), last)
    return torch.where(probs.gather(1, picks) > 0, picks, last)[:, 0]


def adjusted_logits(logits: torch.Tensor, params: list[SamplingParams],
              outputs: Sequence[Sequence[int]] | None) -> torch.Tensor:
    """``logits`` with the logit bias and penalties applied (a copy; itself when no row
    has either)."""
    bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
    pen_rows = [i for i, p in enumerate(params) if p.penalized]
    if not bias_rows and not pen_rows:
        return logits
    x = logits.clone()
    dev = x.device
    if bias_rows:
        r = [i for i in bias_rows for _ in params[i].logit_bias]
        t = [tok for i in bias_rows for tok, _ in params[i].logit_bias]
        b = [bias for i in bias_rows for _, bias in params[i].logit_bias]
        # token ids are unique per row (SamplingParams), so this adds each bias once
        x.index_put_((_on(r, torch.long, dev), _on(t, torch.long, dev)),
                     _on(b, x.dtype, dev), accumulate=True)
    if pen_rows:
        if outputs is None:
            raise ValueError("penalties need each row's output tokens")
        seqs = [outputs[i] for i in pen_rows]
        counts = torch.zeros(len(pen_rows), x.shape[1], dtype=x.dtype, device=dev)
        where = [j for j, s in enumerate(seqs) for _ in s]
        if where:
            toks = _on(list(itertools.chain.from_iterable(seqs)), torch.long, dev)
            counts.index_put_((_on(where, torch.long, dev), toks),
                              torch.ones(len(where), dtype=x.dtype, device=dev),
                              accumulate=True)
        presence = _on([params[i].presence_penalty for i in pen_rows], x.dtype, dev)[:, None]
        frequency = _on([params[i].frequency_penalty for i in pen_rows], x.dtype, dev)[:, None]
        idx = _on(pen_rows, torch.long, dev)
        penalty = presence * (counts > 0).to(x.dtype) + frequency * counts
        x.index_copy_(0, idx, x.index_select(0, idx) - penalty)
    return x


def probabilities(x: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
    """Softmax of the rows of ``x`` after temperature, top-k and top-p ([M, vocab])."""
    if len(ps) == 1:  # the same values with scalars: ~0.1 ms less than the tensor path
        return _probs_row(x[0], ps[0])[None]
    vocab, dev = x.shape[1], x.device

    def column(values: list[int] | list[float], dtype: torch.dtype) -> torch.Tensor:
        return _on(values, dtype, dev)[:, None]

    x = x / column([p.temperature for p in ps], x.dtype)
    m_rows = [j for j, p in enumerate(ps) if p.min_p > 0.0]
    if m_rows:
        sub = x if len(m_rows) == len(ps) else _rows(x, m_rows)
        # p_t >= min_p * p_max  <=>  x_t >= max(x) + log(min_p)
        floor = sub.amax(dim=-1, keepdim=True) + column(
            [math.log(ps[j].min_p) for j in m_rows], x.dtype)
        x = _put_rows(x, m_rows, sub.masked_fill(sub < floor, NEG_INF))
    k_rows = [j for j, p in enumerate(ps) if 0 < p.top_k < vocab]
    if k_rows:
        ks = [ps[j].top_k for j in k_rows]
        sub = x if len(k_rows) == len(ps) else _rows(x, k_rows)
        top = torch.topk(sub, max(ks), dim=-1).values
        kth = top.gather(1, column(ks, torch.long) - 1)
        sub = sub.masked_fill(sub < kth, NEG_INF)
        x = _put_rows(x, k_rows, sub)
    p_rows = [j for j, p in enumerate(ps) if p.top_p < 1.0]
    if p_rows:
        sub = x if len(p_rows) == len(ps) else _rows(x, p_rows)
        top_p = column([ps[j].top_p for j in p_rows], x.dtype)
        sorted_logits, idx = torch.sort(sub, dim=-1, descending=True, stable=True)
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
    if p.min_p > 0.0:
        row = row.masked_fill(row < row.amax() + math.log(p.min_p), NEG_INF)
    if 0 < p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, NEG_INF)
    if p.top_p < 1.0:
        sorted_logits, idx = torch.sort(row, descending=True, stable=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        cum = torch.cumsum(sorted_probs, dim=-1)
        drop = (cum - sorted_probs) >= p.top_p
        sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
        row = torch.empty_like(row).scatter_(0, idx, sorted_logits)
    return torch.softmax(row, dim=-1)


def _on(values: list[int] | list[float], dtype: torch.dtype,
        device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, copied there without waiting for it (a GPU
    tensor indexed with a Python list, or ``torch.tensor(..., device=)``, copies in step)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``x[rows]``, the index on ``x``'s device (``_on``)."""
    return x.index_select(0, _on(rows, torch.long, x.device))


def _put_rows(x: torch.Tensor, rows: list[int], sub: torch.Tensor) -> torch.Tensor:
    """``x`` (a tensor of ``probabilities``' own) with ``rows`` replaced by ``sub`` (``sub``
    itself when it is every row)."""
    if len(rows) == x.shape[0]:
        return sub
    x[_on(rows, torch.long, x.device)] = sub
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
