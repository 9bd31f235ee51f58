"""Token sampling: greedy, temperature, top-k, top-p, with a generator per request.

Each random request draws from its own ``torch.Generator``, seeded from the request's
``seed`` (or from the engine's seed and a counter), and every row is processed on its own,
so a request's tokens do not depend on what else shares its batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .sampling import SamplingParams

Argmax = Callable[[torch.Tensor], list[int]]


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
) -> list[int]:
    """Pick one token per row of ``logits`` ([N, vocab], float32 on the CPU).

    ``argmax``: the first index of each row's largest value, as a list (the model runner's
    native one where it has it)."""
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    out = [0] * len(params)
    if greedy_rows:
        if len(greedy_rows) == len(params):
            return argmax(logits)
        picks = argmax(logits[greedy_rows])
        for i, tok in zip(greedy_rows, picks):
            out[i] = tok
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = _probs(logits[i], p)
        g = generators[i]
        out[i] = int(torch.multinomial(probs, 1, generator=g).item())
    return out


def _probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    row = row / p.temperature
    if p.top_k > 0 and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, idx = torch.sort(row, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        cum = torch.cumsum(sorted_probs, dim=-1)
        drop = (cum - sorted_probs) >= p.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        row = torch.empty_like(row).scatter_(0, idx, sorted_logits)
    return torch.softmax(row, dim=-1)
