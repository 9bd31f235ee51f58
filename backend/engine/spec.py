"""Speculative decoding: a drafter proposes up to K tokens, the target checks them all in
one forward pass, and exactly the target's distribution comes out.

One step of a speculating sequence whose last token (position L-1) is not computed yet:

1. the scheduler reserves 1 + K slots of the step's budget and the KV blocks for
   positions L-1 .. L-1+K (``Scheduler``, ``ScheduledChunk.num_spec``);
2. the drafter proposes m <= K tokens d_1..d_m (``NgramProposer``: the continuation of the
   latest earlier occurrence of the sequence's last n tokens; ``draft.DraftProposer``: a
   small model sharing the tokenizer, m forwards of its own);
3. the target runs its last token and the m drafts as m + 1 decode rows of one step (each
   row is a decode of the same block table at its own context length: every row's K/V is
   written before any row attends, so row j sees d_1..d_j), giving m + 1 rows of logits;
4. ``verify`` accepts a prefix d_1..d_a and adds one token of its own, so a + 1 tokens
   come out of the step:
   - greedy: d_j is accepted while it equals the target's argmax; the first argmax that
     differs is the added token, or, when all m match, the argmax after d_m (the bonus);
   - sampled: d_j, drawn from the draft distribution q, is accepted with probability
     min(1, p(d_j) / q(d_j)) (p: the target's distribution after temperature, top-k,
     top-p and bias, exactly what a plain step would sample from); on the first rejection
     the added token is drawn from the normalised residual max(0, p - q), and when all m
     are accepted it is drawn from p after d_m. The n-gram drafter's q is a point mass on
     its token, so it accepts with probability p(d) and resamples from p without d.
   This keeps each token's distribution exactly the target's (Leviathan et al. 2023;
   the lesson's section 8); a test checks it with a chi-square test;
5. the KV of the accepted drafts stays (they are computed now), the blocks reserved for
   rejected positions go back to the pool (``Scheduler.accept``).

Who speculates: requests that allow it (``SamplingParams.speculative``), without
presence or frequency penalties (those depend on each token before, which the drafts
would have to be re-scored for), not seeded sampled ones (their draws would depend on
how many drafts each step got, which depends on the batch, where a seed promises the
same tokens whatever the batch), and only in steps whose decoding batch is at most
``max_batch`` sequences: a larger batch is compute-bound on the CPU, where the extra
rows cost about what they save (docs/engine.md has the measured threshold).
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from .config import SpecConfig
from .sampler import Argmax, adjusted_logits, probabilities
from .sampling import SamplingParams

__all__ = ["Draft", "NgramProposer", "Proposer", "SpecConfig", "SpecStats", "lookup",
           "verify"]

if TYPE_CHECKING:
    from .scheduler import ScheduledChunk

NGRAM_MAX = 4  # the longest suffix the n-gram drafter looks up
NGRAM_MIN = 1


@dataclass(slots=True)
class Draft:
    """One sequence's proposal: tokens, and the distribution each was drawn from (rows of
    ``probs``, [m, vocab]) when that is not a point mass on the token (the n-gram
    drafter, and greedy drafts, give None)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, chunks: list[ScheduledChunk],
                generators: list[torch.Generator | None]) -> list[Draft]:
        """A draft of at most ``chunk.num_spec`` tokens for each chunk."""
        ...

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy on write of whole KV blocks (the drafter's own cache, if it has one)."""
        ...

    def after_verify(self, chunk: ScheduledChunk, accepted: int) -> None:
        """``accepted`` of the chunk's drafts were accepted."""
        ...


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens
    (n from ``NGRAM_MAX`` down to ``NGRAM_MIN``) and propose what followed it. The
    search is ``bytes.rfind`` over the token ids packed as 32-bit integers, in C."""

    def __init__(self, ngram_max: int = NGRAM_MAX, ngram_min: int = NGRAM_MIN) -> None:
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min

    def propose(self, chunks: list[ScheduledChunk],
                generators: list[torch.Generator | None]) -> list[Draft]:
        return [Draft(lookup(c.seq.token_ids, c.num_spec, self.ngram_max, self.ngram_min))
                for c in chunks]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        pass

    def after_verify(self, chunk: ScheduledChunk, accepted: int) -> None:
        pass


def lookup(tokens: Seq[int], k: int, ngram_max: int = NGRAM_MAX,
           ngram_min: int = NGRAM_MIN) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
    suffix of ``tokens`` (``ngram_max`` .. ``ngram_min`` tokens long). A match p tokens
    back whose continuation runs into the suffix itself continues periodically (the
    proposal for position i is the token at i - p, as in an overlapping LZ77 copy), so a
    sequence looping with a period shorter than ``k`` still gets ``k`` drafts."""
    n_tok = len(tokens)
    if k < 1 or n_tok < 2:
        return []
    packed = array.array("i", tokens)
    if sys.byteorder != "little":
        packed.byteswap()
    haystack = packed.tobytes()
    width = packed.itemsize
    for n in range(min(ngram_max, n_tok - 1), ngram_min - 1, -1):
        needle = haystack[(n_tok - n) * width:]
        hi = (n_tok - 1) * width  # a match must start before the suffix itself
        while (at := haystack.rfind(needle, 0, hi)) >= 0:
            if at % width == 0:  # on token boundaries
                start = at // width + n
                period = n_tok - start
                return [tokens[start + j] if j < period else tokens[start + j % period]
                        for j in range(k)]
            hi = at + len(needle) - 1  # the next match to the left
    return []


@dataclass(slots=True)
class SpecStats:
    """Counters since start: drafts proposed and accepted, verify rows, draft time."""

    proposed: int = 0
    accepted: int = 0
    verified: int = 0  # sequence-steps that verified at least one draft
    emitted: int = 0  # tokens those sequence-steps produced (accepted + one each)
    draft_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a verifying sequence gets out of one step (1 without speculation)."""
        return self.emitted / self.verified if self.verified else 0.0


def verify(logits: torch.Tensor, drafts: list[Draft], params: list[SamplingParams],
           generators: list[torch.Generator | None],
           argmax: Argmax) -> list[tuple[list[int], int]]:
    """Check each sequence's draft against its target rows.

    ``logits``: float32 [sum(m_i + 1), vocab], each sequence's m_i + 1 rows together (row
    j gives the distribution of the token after its j-th draft). Returns, per sequence,
    the tokens it emits (accepted drafts, then the target's own) and how many drafts were
    accepted. ``logits`` is not modified."""
    row_params = [p for d, p in zip(drafts, params) for _ in range(len(d.tokens) + 1)]
    x = adjusted_logits(logits, row_params, None)  # speculating rows have no penalties
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + len(d.tokens) + 1)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    picks: dict[int, list[int]] = {}
    if greedy:  # one argmax over every greedy row of the step
        rows = [r for i in greedy for r in range(starts[i], starts[i + 1])]
        flat = argmax(x if len(rows) == x.shape[0] else x[rows])
        at = 0
        for i in greedy:
            n = starts[i + 1] - starts[i]
            picks[i] = flat[at:at + n]
            at += n
    out: list[tuple[list[int], int]] = []
    for i, (d, p) in enumerate(zip(drafts, params)):
        if i in picks:
            out.append(_verify_greedy(d.tokens, picks[i]))
        else:
            rows_i = x[starts[i]:starts[i + 1]]
            out.append(_verify_sampled(d, probabilities(rows_i, [p] * rows_i.shape[0]),
                                       generators[i]))
    return out


def residual(p: torch.Tensor, q: torch.Tensor | None, tok: int) -> torch.Tensor:
    """What a rejected draft ``tok`` is replaced from: max(0, p - q), unnormalised
    (``multinomial`` normalises). ``q`` None is a point mass on ``tok``: p without it."""
    if q is None:
        r = p.clone()
        r[tok] = 0.0
    else:
        r = (p - q).clamp_min_(0.0)
    if not float(r.sum()) > 0.0:  # only by rounding, where p and q agree
        return p
    return r


def _verify_greedy(draft: list[int], argmaxes: list[int]) -> tuple[list[int], int]:
    for j, tok in enumerate(draft):
        if argmaxes[j] != tok:
            return draft[:j] + [argmaxes[j]], j
    return draft + [argmaxes[len(draft)]], len(draft)


def _verify_sampled(d: Draft, p: torch.Tensor,
                    generator: torch.Generator | None) -> tuple[list[int], int]:
    """The exact rule over one sequence's rows ``p`` ([m + 1, vocab] probabilities)."""
    for j, tok in enumerate(d.tokens):
        p_tok = float(p[j, tok])
        q_row = None if d.probs is None else d.probs[j]
        q_tok = 1.0 if q_row is None else float(q_row[tok])
        u = float(torch.rand((), generator=generator))
        if u * q_tok < p_tok:  # accepted with probability min(1, p / q)
            continue
        added = int(torch.multinomial(residual(p[j], q_row, tok), 1,
                                      generator=generator).item())
        return d.tokens[:j] + [added], j
    bonus = int(torch.multinomial(p[len(d.tokens)], 1, generator=generator).item())
    return d.tokens + [bonus], len(d.tokens)
