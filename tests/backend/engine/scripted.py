"""A scripted model and a character detokenizer: the engine core without a model.

Shared by the engine's and the bench's tests (imported explicitly, not a conftest)."""

from __future__ import annotations

import time
from typing import Any

import torch

from backend.engine.block_manager import BlockManager
from backend.engine.engine import LLMEngine
from backend.engine.scheduler import ScheduledChunk, Scheduler

VOCAB = 32
EOS = 0
# token id -> text; ids 1..26 are letters, 27 is "ab", 28 is "\n", 29 is "xyz"
PIECES = {i: chr(ord("a") + i - 1) for i in range(1, 27)} | {27: "ab", 28: "\n", 29: "xyz"}


class ScriptedRunner:
    """Next token = script[request's number of output tokens], per prompt's first token."""

    def __init__(self, scripts: dict[int, list[int]]):
        self.scripts = scripts
        self.calls = 0
        self.steps: list[list[tuple[str, int]]] = []  # (request id, new tokens) per call
        self.copies: list[tuple[int, int]] = []  # copy-on-write block copies asked for

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.copies.extend(copies)

    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        self.calls += 1
        self.steps.append([(c.seq.request_id, c.num_new_tokens) for c in chunks])
        rows = []
        for c in chunks:
            if not c.samples:
                continue
            seq = c.seq
            script = self.scripts.get(seq.prompt_token_ids[0], [5])
            tok = script[min(seq.num_output_tokens, len(script) - 1)]
            row = torch.zeros(VOCAB)
            row[tok] = 10.0
            rows.append(row)
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)


class CharDetok:
    def __init__(self, prompt: list[int]):
        del prompt

    def add(self, ids: list[int]) -> str:
        return "".join(PIECES.get(i, "?") for i in ids)

    def flush(self) -> str:
        return ""


SCHEDULER_ARGS = ("num_blocks", "block_size", "max_model_len", "max_num_seqs",
                  "max_num_batched_tokens", "clock")


def make_scheduler(**kw: Any) -> Scheduler:
    """64 blocks of 4 tokens, 64-token context, 8 sequences and 32 tokens per step unless
    ``kw`` says otherwise."""
    a: dict[str, Any] = {"num_blocks": 64, "block_size": 4, "max_model_len": 64,
                         "max_num_seqs": 8, "max_num_batched_tokens": 32,
                         "clock": time.monotonic} | kw
    return Scheduler(BlockManager(a["num_blocks"], a["block_size"]),
                     max_num_seqs=a["max_num_seqs"],
                     max_num_batched_tokens=a["max_num_batched_tokens"],
                     max_model_len=a["max_model_len"], clock=a["clock"])


def make_engine(scripts: dict[int, list[int]], **kw: Any) -> LLMEngine:
    """An engine over the scripted model; scheduler keywords (``SCHEDULER_ARGS``) go to
    ``make_scheduler``, the others to ``LLMEngine``."""
    scheduler = make_scheduler(**{k: kw.pop(k) for k in SCHEDULER_ARGS if k in kw})
    args: dict[str, Any] = {
        "runner": ScriptedRunner(scripts), "scheduler": scheduler, "vocab_size": VOCAB,
        "eos_token_ids": (EOS,), "make_detokenizer": CharDetok,
        "make_salt": lambda s: (s or "").encode()}
    args.update(kw)
    return LLMEngine(**args)


def slow_down(engine: LLMEngine, seconds: float = 0.005) -> None:
    """Make every step take at least ``seconds``: the scripted model is so fast that a
    request can finish before an abort sent from the event loop lands."""
    execute = engine.runner.execute

    def slow_execute(chunks):
        time.sleep(seconds)
        return execute(chunks)

    engine.runner.execute = slow_execute


def run_all(engine: LLMEngine) -> dict[str, list]:
    deltas: dict[str, list] = {}
    for _ in range(500):
        if not engine.has_work():
            break
        for d in engine.step():
            deltas.setdefault(d.request_id, []).append(d)
    return deltas
