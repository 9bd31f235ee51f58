"""The fused small-batch decode step (one C call for every layer) against transformers and
against the torch-ops path it replaces."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from backend.engine.decode_kernel import DecodeKernel
from backend.engine.fused_decode import MAX_ROWS, FusedDecoder
from backend.engine.loader import load_model
from backend.engine.models.llama import LlamaForCausalLM
from tests.backend.engine.conftest import fused_or_skip
from tests.backend.engine.conftest_models import PagedRunner, hf_logits, save_hf_checkpoint

pytest.importorskip("transformers")

KINDS = ["llama3", "llama_tied", "mistral", "qwen2"]  # qwen2: q/k/v biases


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class _Spy:
    """Records the rows of each fused step: ``rows`` (all in C), ``packed_rows`` (oneDNN
    matmuls with C between them)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        fused_or_skip(model)
        self.rows: list[int] = []
        self.packed_rows: list[int] = []
        for name, log in (("forward", self.rows), ("forward_packed", self.packed_rows)):
            inner = getattr(model.fused, name)

            def spy(input_ids: torch.Tensor, *args: Any, _inner: Any = inner,
                    _log: list[int] = log) -> torch.Tensor:
                _log.append(input_ids.shape[0])
                return cast(torch.Tensor, _inner(input_ids, *args))

            setattr(model.fused, name, spy)


def _fast(path: Path, dtype: torch.dtype, kernel: DecodeKernel) -> tuple[Any, _Spy]:
    """The model as the engine builds it on the CPU: prepacked matmuls, kernel, fused."""
    loaded = load_model(path, dtype, torch.device("cpu"))
    loaded.model.prepack_cpu_matmuls()
    loaded.model.set_decode_kernel(kernel)
    return loaded, _Spy(loaded.model)


@pytest.mark.parametrize("kind", KINDS)
def test_fused_decode_matches_hf(tmp_path: Path, kernel: DecodeKernel, kind: str) -> None:
    """Decode steps of 1, 2 and 3 sequences on shuffled blocks, float32: every logit row
    within 1e-4 of transformers."""
    hf = save_hf_checkpoint(kind, tmp_path, seed=3)
    loaded, spy = _fast(tmp_path, torch.float32, kernel)
    seqs = [_tokens(30, 20), _tokens(26, 21), _tokens(23, 22)]
    runner = PagedRunner(loaded.model, loaded.config, block_size=4, seed=9)
    got: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
    fed = [20, 17, 15]  # prefill lengths, then one token per decode

    def run(sids: list[int]) -> None:
        work = []
        for sid in sids:
            n = 1 if got[sid] else fed[sid]
            start = fed[sid] if got[sid] else 0
            work.append((sid, seqs[sid][start:start + n]))
            if got[sid]:
                fed[sid] += 1
        for (sid, _), rows in zip(work, runner.step(work), strict=True):
            got[sid].append(rows)

    run([0, 1, 2])  # prefill (torch ops)
    for _ in range(2):  # one sequence alone, then two, then all three, in mixed orders
        run([0])
        run([1, 0])
        run([2, 0, 1])
    assert sorted(set(spy.rows)) == [1, 2, 3]
    for sid, toks in enumerate(seqs):
        ours = torch.cat(got[sid])
        ref = hf_logits(hf, toks[:ours.shape[0]])
        diff = (ours - ref).abs().max().item()
        assert diff <= 1e-4, f"{kind}: sequence {sid} max abs diff {diff}"


@pytest.mark.parametrize(("kind", "n"), [("qwen2", 13), ("llama_tied", MAX_ROWS + 3)])
def test_larger_decode_batches_match_hf(tmp_path: Path, kernel: DecodeKernel, kind: str,
                                        n: int) -> None:
    """Decode batches of 13 sequences (the C matmuls' 6 x 16 micro-kernel, zero-padded to
    16 inputs) and of more than MAX_ROWS (oneDNN matmuls, C norms, rotary, attention and
    silu between them), float32: within 1e-4 of transformers."""
    hf = save_hf_checkpoint(kind, tmp_path, seed=6)
    loaded, spy = _fast(tmp_path, torch.float32, kernel)
    seqs = [_tokens(12 + i, 60 + i) for i in range(n)]
    runner = PagedRunner(loaded.model, loaded.config, block_size=4, num_blocks=1024, seed=4)
    got: dict[int, list[torch.Tensor]] = {i: [] for i in range(n)}
    prompt = {i: len(s) - 3 for i, s in enumerate(seqs)}
    for sid, rows in enumerate(runner.step([(i, s[:prompt[i]]) for i, s in enumerate(seqs)])):
        got[sid].append(rows)
    for step in range(3):
        order = list(range(n))[::-1] if step % 2 else list(range(n))
        work = [(i, [seqs[i][prompt[i] + step]]) for i in order]
        for (sid, _), rows in zip(work, runner.step(work), strict=True):
            got[sid].append(rows)
    if n > MAX_ROWS:
        assert spy.packed_rows == [n] * 3 and not spy.rows
    else:
        assert spy.rows == [n] * 3 and not spy.packed_rows
    for sid, toks in enumerate(seqs):
        ours = torch.cat(got[sid])
        diff = (ours - hf_logits(hf, toks[:ours.shape[0]])).abs().max().item()
        assert diff <= 1e-4, f"{kind}: sequence {sid} max abs diff {diff}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_decode_matches_torch_path_up_to_max_rows(tmp_path: Path, kernel: DecodeKernel,
                                                        dtype: torch.dtype) -> None:
    """Batches of 1..MAX_ROWS + 1 decodes: the fused steps (all in C up to MAX_ROWS, oneDNN
    matmuls with C between them above) and the torch path they replace agree; so does
    the K/V they write into the cache."""
    save_hf_checkpoint("qwen2", tmp_path, seed=5)
    plain = load_model(tmp_path, dtype, torch.device("cpu"))
    plain.model.prepack_cpu_matmuls()
    plain.model.set_decode_kernel(kernel, fused=False)
    assert plain.model.fused is None
    fast, spy = _fast(tmp_path, dtype, kernel)
    n = MAX_ROWS + 1
    prompts = [_tokens(5 + 3 * i, 40 + i) for i in range(n)]
    runners = [PagedRunner(m.model, m.config, dtype=dtype, num_blocks=4096, seed=2)
               for m in (plain, fast)]
    for r in runners:
        r.step([(i, p) for i, p in enumerate(prompts)])
    tol = 1e-4 if dtype == torch.float32 else 0.1
    for rows in range(1, n + 1):
        work = [(i, [(7 * rows + i) % 300]) for i in reversed(range(rows))]
        ref, got = (torch.cat(r.step(work)) for r in runners)
        diff = (got - ref).abs().max().item()
        assert diff <= tol, f"{rows} rows: max abs diff {diff}"
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    assert spy.rows == list(range(1, MAX_ROWS + 1))
    assert spy.packed_rows == [MAX_ROWS + 1]  # oneDNN's matmuls, C between them
    for (k_ref, v_ref), (k_got, v_got) in zip(runners[0].kv, runners[1].kv, strict=True):
        assert (k_got.float() - k_ref.float()).abs().max().item() <= tol
        assert (v_got.float() - v_ref.float()).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "k", "out"),
                         [(1, 64, 200), (3, 64, 200), (9, 1048, 600), (10, 64, 205),
                          (13, 1048, 600), (16, 136, 600), (20, 1048, 601), (26, 64, 205),
                          (32, 72, 601), (45, 64, 205), (MAX_ROWS, 72, 601)])
def test_fused_linear(kernel: DecodeKernel, tmp_path: Path, dtype: torch.dtype, rows: int,
                      k: int, out: int) -> None:
    """Against a float32 matmul. Up to 9 inputs the dot kernel: single passes, or 8 inputs
    at a time over weight tiles and K chunks (1048 = 2 x 512 + 24). From 10 the 6 x 16
    micro-kernel, 16 inputs a pass (10, 13, 26: zero-padded; 20: 16 wide and 4 the dot
    way), over several 96-row tiles (600 rows), with each thread's last rows (< 24) the
    dot way (205, 601)."""
    save_hf_checkpoint("llama3", tmp_path, seed=1)
    loaded = load_model(tmp_path, dtype, torch.device("cpu"))
    loaded.model.set_decode_kernel(kernel)
    fused = fused_or_skip(loaded.model)
    gen = torch.Generator().manual_seed(rows)
    # output rows not a multiple of the 8-row shares; a bias on every row
    w = torch.randn(out, k, generator=gen).to(dtype)
    b = torch.randn(out, generator=gen).to(dtype)
    x = torch.randn(rows, k, generator=gen)
    ref = x @ w.float().T + b.float()
    got = fused.linear(x, w, b)
    assert got.dtype == torch.float32 and got.shape == (rows, out)
    assert (got - ref).abs().max().item() <= 1e-4 * k ** 0.5
    for bad in (torch.randn(MAX_ROWS + 1, k), torch.randn(rows, k + 8), x.double()):
        with pytest.raises(ValueError, match="fused linear"):  # never reads out of bounds
            fused.linear(bad, w, None)
    with pytest.raises(ValueError, match="fused linear"):
        fused.linear(x, w, b[:-1])


def test_unsupported_models_keep_the_torch_path(tmp_path: Path, kernel: DecodeKernel) -> None:
    save_hf_checkpoint("llama3", tmp_path, seed=1)
    half = load_model(tmp_path, torch.float16, torch.device("cpu"))
    half.model.set_decode_kernel(kernel)
    assert half.model.fused is None and half.model.decode_kernel is kernel
    ok = load_model(tmp_path, torch.float32, torch.device("cpu"))
    assert FusedDecoder.supports(ok.model.decoder_weights())
    # the AVX2 kernels need head_dim % 16 == 0
    ok.model.config = dataclasses.replace(ok.model.config, head_dim=8)
    assert not FusedDecoder.supports(ok.model.decoder_weights())


def test_native_argmax_equals_torch(tmp_path: Path, kernel: DecodeKernel) -> None:
    """Greedy picks: the first index of each row's maximum, ties included, any width."""
    save_hf_checkpoint("llama3", tmp_path, seed=1)
    loaded = load_model(tmp_path, torch.float32, torch.device("cpu"))
    loaded.model.set_decode_kernel(kernel)
    fused = fused_or_skip(loaded.model)
    gen = torch.Generator().manual_seed(0)
    for rows, vocab in [(1, 300), (5, 32003), (33, 17), (2, 7)]:
        x = torch.randn(rows, vocab, generator=gen)
        x[0, vocab // 2] = x[0, -1] = x[0].max() + 1  # a tie: the first wins
        if rows > 1:
            x[1, -1] = x[1].max() + 1  # the maximum in the scalar tail
        assert fused.argmax(x) == x.argmax(dim=-1).tolist()
    ties = torch.zeros(3, 40)
    assert fused.argmax(ties) == [0, 0, 0]
    nan = torch.randn(3, 32000, generator=gen)
    nan[0] = float("nan")  # every value NaN: torch's pick, never an index past the end
    nan[2, 5] = float("nan")
    assert fused.argmax(nan) == nan.argmax(dim=-1).tolist()


def test_fused_step_follows_a_model_moved_after_binding(tmp_path: Path,
                                                        kernel: DecodeKernel) -> None:
    """The C struct holds the weights' addresses: a model converted after its first fused
    step (``.to(torch.bfloat16)``, new storage) gets a fused step bound to the new weights,
    never one reading where they were."""
    save_hf_checkpoint("llama3", tmp_path, seed=2)
    loaded = load_model(tmp_path, torch.float32, torch.device("cpu"))
    model: Any = loaded.model
    model.set_decode_kernel(kernel)  # no prepacked copies: the torch path reads the same
    _Spy(model)
    prompt = _tokens(9, 70)
    first = PagedRunner(model, loaded.config, seed=1)
    first.step([(0, prompt)])
    first.step([(0, [5])])
    before = model.fused
    model.to(torch.bfloat16)
    assert model.fused is not before and model.fused.dtype == torch.bfloat16
    spy = _Spy(model)
    got_runner = PagedRunner(model, loaded.config, dtype=torch.bfloat16, seed=1)
    got = got_runner.step([(0, prompt)]) + got_runner.step([(0, [5])])
    assert spy.rows == [1]
    fused, model.fused = model.fused, None
    plain = PagedRunner(model, loaded.config, dtype=torch.bfloat16, seed=1)
    ref = plain.step([(0, prompt)]) + plain.step([(0, [5])])
    model.fused = fused
    assert (torch.cat(got) - torch.cat(ref)).abs().max().item() <= 0.1




def test_engine_greedy_uses_the_native_argmax(kernel: DecodeKernel) -> None:
    from backend.engine.builder import build_engine
    from backend.engine.config import EngineConfig
    from backend.engine.sampling import SamplingParams

    parts = build_engine(EngineConfig(model="tiny", kv_blocks=64, max_model_len=128))
    runner: Any = parts.runner
    fused_or_skip(runner.model)
    calls: list[int] = []
    inner = runner.model.fused.argmax

    def spy(logits: torch.Tensor) -> list[int]:
        calls.append(logits.shape[0])
        return inner(logits)

    runner.model.fused.argmax = spy
    core = parts.core
    core.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
    while core.has_work():
        core.step()
    assert calls and set(calls) == {1}


def test_a_strided_or_mistyped_step_input_is_refused(tmp_path: Path,
                                                     kernel: DecodeKernel) -> None:
    """The C step reads its inputs by address: a strided view (read as if contiguous, it
    gave wrong tokens) or another dtype is an error, not a wrong answer."""
    save_hf_checkpoint("qwen2", tmp_path, seed=5)
    fast, _ = _fast(tmp_path, torch.float32, kernel)
    fused = fused_or_skip(fast.model)
    d = fast.config.head_dim
    ids = torch.tensor([[3, 9], [4, 9]])[:, 0]  # a column: stride 2
    cos, sin = torch.ones(2, d), torch.zeros(2, d)
    tables, lens = torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, dtype=torch.int64)
    for bad in ({"input_ids": ids}, {"input_ids": ids.contiguous().int()},
                {"tables": tables.int()}, {"context_lens": lens[:1]}):
        args = {"input_ids": ids.contiguous(), "cos": cos, "sin": sin, "tables": tables,
                "context_lens": lens} | bad
        with pytest.raises(ValueError, match="contiguous CPU"):
            fused.forward(args["input_ids"], args["cos"], args["sin"], args["tables"],
                          args["context_lens"], [], torch.empty(0))
