"""The draft-model drafter for speculative decoding (``spec.py``).

A small checkpoint sharing the target's tokenizer (and vocabulary) proposes m tokens one
forward at a time. Its KV cache is its own tensors, laid out on the target's block
tables: a token at position p of a sequence has its draft K/V in the same block and slot
as its target K/V, so the draft needs no allocator, and blocks the scheduler reserves,
shares, copies on write or frees are the draft's too.

Each sequence tracks how many of its leading tokens the draft has computed
(``Sequence.num_draft_computed_tokens``; 0 after a preemption). A round of drafting:

- the first forward catches the draft up on what it has not seen (the prompt after a
  prefix-cache hit or the first time, the tokens a step emitted after its drafts) and
  gives the first draft token;
- m - 1 decode forwards give the others;
- after verification only the accepted drafts' draft K/V stays counted.

Each draft token is drawn from the draft's distribution after the request's own
temperature, top-k, top-p and logit bias (the argmax for greedy requests), with the
request's generator, and that distribution is what the exact rule divides by.
"""

from __future__ import annotations

from pathlib import Path

import torch

from modelfiles.model_config import ModelConfig

from .config import EngineConfig
from .decode_kernel import load_decode_kernel
from .errors import InvalidRequestError
from .loader import LoadedModel, load_model
from .model_runner import ModelRunner
from .models.linear import can_prepack
from .sampler import Argmax, adjusted_logits, probabilities
from .scheduler import ScheduledChunk
from .spec import Draft


class DraftProposer:
    def __init__(self, runner: ModelRunner, argmax: Argmax) -> None:
        self.runner = runner
        self._argmax = argmax

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.runner.copy_blocks(copies)

    def propose(self, chunks: list[ScheduledChunk],
                generators: list[torch.Generator | None]) -> list[Draft]:
        seqs = [c.seq for c in chunks]
        tokens: list[list[int]] = [[] for _ in chunks]
        probs: list[list[torch.Tensor]] = [[] for _ in chunks]
        ids: list[int] = []
        specs: list[tuple[list[int], int, int]] = []
        for seq in seqs:  # catch up, and the first draft token
            n = seq.num_tokens
            done = min(seq.num_draft_computed_tokens, n - 1)
            ids.extend(seq.token_ids[done:n])
            specs.append((seq.block_table, done, n - done))
            seq.num_draft_computed_tokens = n
        active = list(range(len(chunks)))
        logits = self.runner.run(ids, specs, active)
        for r in range(max(c.num_spec for c in chunks)):
            if r:
                ids = [tokens[i][-1] for i in active]
                specs = [(seqs[i].block_table, seqs[i].num_tokens - 1 + r, 1) for i in active]
                logits = self.runner.run(ids, specs, list(range(len(active))))
                for i in active:
                    seqs[i].num_draft_computed_tokens += 1
            self._draw(logits, [chunks[i] for i in active], [generators[i] for i in active],
                       [tokens[i] for i in active], [probs[i] for i in active])
            active = [i for i in active if chunks[i].num_spec > r + 1]
            if not active:
                break
        return [Draft(t, torch.stack(q) if q else None) for t, q in zip(tokens, probs)]

    def _draw(self, logits: torch.Tensor, chunks: list[ScheduledChunk],
              generators: list[torch.Generator | None], tokens: list[list[int]],
              probs: list[list[torch.Tensor]]) -> None:
        """One draft token per row: the argmax for greedy requests, else a draw from the
        request's distribution over the draft logits (kept, for the exact rule)."""
        params = [c.seq.params for c in chunks]
        x = adjusted_logits(logits, params, None)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            for i, tok in zip(greedy, self._argmax(x[greedy] if len(greedy) < len(params)
                                                   else x)):
                tokens[i].append(tok)
        for i, p in enumerate(params):
            if p.greedy:
                continue
            q = probabilities(x[i:i + 1], [p])[0]
            tokens[i].append(int(torch.multinomial(q, 1, generator=generators[i]).item()))
            probs[i].append(q)

    def after_verify(self, chunk: ScheduledChunk, accepted: int) -> None:
        """Draft K/V counts for the tokens before the first rejected draft only."""
        seq = chunk.seq
        seq.num_draft_computed_tokens = min(seq.num_draft_computed_tokens,
                                            chunk.start + 1 + accepted)


def load_draft(path: str, target: ModelConfig, dtype: torch.dtype, device: torch.device,
               config: EngineConfig) -> LoadedModel:
    """The draft checkpoint at ``path``, ready to run like the target (same dtype, device
    and CPU kernels); refused unless it shares the target's vocabulary and reaches its
    context length."""
    loaded = load_model(Path(path).expanduser(), dtype, device)
    cfg = loaded.config
    if cfg.vocab_size != target.vocab_size:
        raise InvalidRequestError(
            f"the draft model's vocabulary ({cfg.vocab_size}) is not the target's "
            f"({target.vocab_size}); a draft must share the tokenizer", "speculative")
    wanted = config.max_model_len or target.max_position_embeddings
    if cfg.max_position_embeddings < wanted:
        raise InvalidRequestError(
            f"the draft model reaches {cfg.max_position_embeddings} positions, the target "
            f"{wanted}", "speculative")
    if can_prepack(device):
        loaded.model.prepack_cpu_matmuls()
    if device.type == "cpu" and config.decode_kernel:
        loaded.model.set_decode_kernel(load_decode_kernel(), fused=config.fused_decode)
    return loaded
