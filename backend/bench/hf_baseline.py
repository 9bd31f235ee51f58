"""Baseline: ``transformers`` generate in request-level batches, in real time.

The same checkpoint, dtype and device as the engine. A batch is formed when the previous
one has returned, from the requests that have arrived (up to ``max_batch``, oldest first);
prompts are left-padded to the longest, and the batch generates the longest requested
output for every row (``min_new_tokens == max_new_tokens``, greedy). Only each request's
own requested tokens are counted. All rows of a batch finish when ``generate`` returns;
TTFT is when the batch's first token exists (a stopping-criteria hook sees it).
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from .workload import BenchRequest, RunStats


class _FirstTokenClock:
    """A stopping criterion that never stops; it notes when the first token is out."""

    def __init__(self) -> None:
        self.first: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        if self.first is None:
            self.first = time.monotonic()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def load_hf_model(path: Path, dtype: torch.dtype, device: torch.device) -> Any:
    try:
        from transformers import LlamaForCausalLM
    except ImportError as exc:  # a test-only dependency of the project
        raise RuntimeError("the HF baseline needs `transformers` (pip install "
                           "'sluice[test]')") from exc
    model: Any = LlamaForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                  attn_implementation="sdpa")
    return model.to(device).eval()


@torch.inference_mode()
def _generate(model: Any, batch: list[BenchRequest], device: torch.device,
              clock: _FirstTokenClock) -> None:
    from transformers import StoppingCriteriaList

    longest = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros(len(batch), longest, dtype=torch.long)
    for i, r in enumerate(batch):
        n = len(r.prompt_token_ids)
        ids[i, longest - n:] = torch.tensor(r.prompt_token_ids)
        mask[i, longest - n:] = 1
    new = max(r.max_tokens for r in batch)
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                         max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         pad_token_id=0, stopping_criteria=StoppingCriteriaList([clock]))
    if out.shape[1] != longest + new:
        raise RuntimeError(f"generate returned {out.shape[1] - longest} tokens, not {new}")


def serve_hf(model: Any, requests: list[BenchRequest], max_batch: int,
             device: torch.device) -> RunStats:
    """Run the workload through ``generate`` batches, honouring arrival times."""
    pending = deque(sorted(requests, key=lambda r: r.arrival))
    start = time.monotonic()
    ttfts: list[float] = []
    last_finish = start
    while pending:
        now = time.monotonic()
        if start + pending[0].arrival > now:
            time.sleep(start + pending[0].arrival - now)
            continue
        batch: list[BenchRequest] = []
        while pending and len(batch) < max_batch and start + pending[0].arrival <= now:
            batch.append(pending.popleft())
        clock = _FirstTokenClock()
        _generate(model, batch, device, clock)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        last_finish = time.monotonic()
        first = clock.first if clock.first is not None else last_finish
        ttfts.extend(first - (start + r.arrival) for r in batch)
    tokens = sum(r.max_tokens for r in requests)
    return RunStats("hf-generate", tokens, last_finish - start, ttfts)


def warm_up_hf(model: Any, device: torch.device) -> None:
    reqs = [BenchRequest(f"hfwarm{i}", list(range(5, 5 + 8 + i)), 4, 0.0) for i in range(2)]
    _generate(model, reqs, device, _FirstTokenClock())
