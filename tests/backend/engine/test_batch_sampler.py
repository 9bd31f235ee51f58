"""The device sampler (``sample_batch``: every row at once, picks left on the device)
against the host one (``sample``): the same tokens for greedy, seeded and engine-seeded
rows, the right distribution for rows on torch's default generator, and an engine step
on it that reads one tensor back to the host: the picked ids."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.engine.builder import EngineParts, build_engine
from backend.engine.config import EngineConfig
from backend.engine.host_sync import count_host_syncs
from backend.engine.sampler import (
    pick_tokens,
    probabilities,
    sample,
    sample_batch,
    torch_argmax,
)
from backend.engine.sampling import SamplingParams

from .test_sampler import VOCAB, gens, logits_of, params_st


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(st.tuples(params_st, st.lists(st.integers(0, VOCAB - 1), max_size=12),
                               st.booleans()),
                     min_size=1, max_size=9),
       seed=st.integers(0, 2**16), scale=st.sampled_from([0.5, 3.0, 12.0]))
def test_the_batch_picks_what_the_host_sampler_picks(rows, seed: int, scale: float) -> None:
    params = [p for p, _, _ in rows]
    outputs = [o for _, o, _ in rows]
    logits = logits_of(seed, len(rows), scale)

    def generators() -> list[torch.Generator | None]:
        # a row without a generator draws from torch's default one, in row order in both
        return [None if unseeded else g for g, (_, _, unseeded) in zip(gens(params), rows)]

    torch.manual_seed(seed)
    expected = sample(logits, params, generators(), outputs=outputs)
    torch.manual_seed(seed)
    got = sample_batch(logits, params, generators(), outputs=outputs)
    assert got.dtype == torch.int64 and got.device == logits.device
    assert got.tolist() == expected
    assert torch.equal(logits, logits_of(seed, len(rows), scale))  # left alone


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.2),
])
def test_rows_on_the_default_generator_follow_their_distribution(
        params: SamplingParams) -> None:
    """20,000 rows of one 8-token distribution in one batch, torch's default generator
    seeded: the counts against the expected ones by a chi-square statistic, under the
    critical value of p = 1e-6 (7 degrees of freedom: 35.3)."""
    n, vocab = 20_000, 8
    logits = torch.tensor([[2.0, 1.5, 1.2, 1.0, 0.4, 0.0, -0.5, -1.5]]).expand(n, vocab)
    expected = probabilities(logits[:2], [params, params])[0] * n
    torch.manual_seed(11)
    counts = torch.bincount(sample_batch(logits, [params] * n, [None] * n),
                            minlength=vocab).double()
    assert counts[expected == 0].sum() == 0  # nothing outside the kept tokens
    kept = expected > 0
    chi2 = float((((counts - expected) ** 2)[kept] / expected[kept]).sum())
    assert chi2 < 35.3, (counts.tolist(), expected.tolist())


def make(cache: Path, **kw: object) -> EngineParts:
    base: dict[str, object] = {"model": "tiny", "cache_dir": str(cache), "device": "cpu",
                               "dtype": "float32", "block_size": 4, "kv_blocks": 256}
    base.update(kw)
    return build_engine(EngineConfig(**base))  # type: ignore[arg-type]


MIX = [
    SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=3,
                   ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=1.0, presence_penalty=0.5,
                   frequency_penalty=0.3, logit_bias=((5, 2.0),), ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.9, ignore_eos=True),  # engine-seeded
    SamplingParams(max_tokens=24, temperature=0.9, seed=5, n=2, ignore_eos=True),
]


def test_one_device_step_reads_back_only_the_picked_ids(tmp_path: Path) -> None:
    """The plain torch model path (what a GPU runs) with the device sampler: a step of
    decodes, and one that also prefills a new request, each make one read of a tensor
    into Python (``.tolist()`` of the ids); the rest stays on the device."""
    core = make(tmp_path, decode_kernel=False, fused_decode=False, device_sampler=True).core
    for i, p in enumerate(MIX):
        core.add_request(f"r{i}", [3 + i, 7, 9, 11, 13], p)
    for _ in range(3):
        core.step()
    assert len(core.scheduler.running) == 6  # every choice decodes
    with count_host_syncs() as calls:
        core.step()
    assert len(calls) == 1 and calls[0].startswith("tolist at "), calls
    core.add_request("late", list(range(3, 40)), MIX[1])
    with count_host_syncs() as calls:
        deltas = core.step()
    assert any(d.request_id == "late" for d in deltas)  # its prefill ran in that step
    assert len(calls) == 1, calls


def test_the_host_counter_sees_a_read_in_the_model(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The counter is not blind to the model path: an ``.item()`` there is counted."""
    core = make(tmp_path, decode_kernel=False, fused_decode=False, device_sampler=True).core
    model = core.runner.model  # type: ignore[attr-defined]
    forward = model.compute_logits

    def reading(hidden: torch.Tensor) -> torch.Tensor:
        hidden.sum().item()
        return forward(hidden)

    monkeypatch.setattr(model, "compute_logits", reading)
    core.add_request("r", [3, 7, 9], MIX[0])
    with count_host_syncs() as calls:
        core.step()
    assert len(calls) == 2, calls


def test_the_engine_gives_the_same_tokens_with_either_sampler(tmp_path: Path) -> None:
    def run(device_sampler: bool) -> dict[str, list[int]]:
        core = make(tmp_path, device_sampler=device_sampler).core
        for i, p in enumerate(MIX):
            core.add_request(f"r{i}", [3 + i, 7, 9, 11, 13], p)
        out: dict[str, list[int]] = {}
        while core.has_work():
            for d in core.step():
                out.setdefault(f"{d.request_id}/{d.index}", []).extend(d.token_ids)
        return out

    host, device = run(False), run(True)
    assert len(host) == 6 and all(len(t) == 24 for t in host.values())
    assert device == host


def test_no_rows_and_nan_rows() -> None:
    """A step of prefill chunks only samples nothing; a row of NaN logits picks a token in
    the vocabulary (an id past it would fail the next step's embedding on a GPU)."""
    empty = torch.empty(0, 0)
    assert sample_batch(empty, [], []).tolist() == []
    assert pick_tokens(empty, [], [], torch_argmax, [], None, True) == ([], [])
    logits = torch.tensor([[1.0, float("nan"), 2.0, 0.0], [0.5, 0.1, 0.2, 0.3]])
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.7, seed=2)]
    for picks in (sample_batch(logits, params, gens(params)).tolist(),
                  sample(logits, params, gens(params))):
        assert all(0 <= t < 4 for t in picks), picks


def test_a_long_prompt_alone_prefills_in_chunks_on_the_device_sampler(tmp_path: Path) -> None:
    """Steps of one mid-prefill chunk (nothing decodes, nothing samples) on the device
    sampler: the steps run and the request gets its tokens."""
    core = make(tmp_path, device_sampler=True, max_num_batched_tokens=16).core
    core.add_request("long", list(range(3, 43)), MIX[1])
    tokens: list[int] = []
    while core.has_work():
        for d in core.step():
            tokens.extend(d.token_ids)
    assert len(tokens) == 24
