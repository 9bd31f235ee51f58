"""Logprobs, logit bias and penalties through the engine with the real (tiny) model, the
logprobs checked against transformers' logits for the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.engine.outputs import TokenLogprob
from backend.engine.sampling import SamplingParams

from .test_engine_model import make

transformers = pytest.importorskip("transformers")


def generate(parts, requests) -> dict[str, tuple[list[int], list[TokenLogprob]]]:
    core = parts.core
    for rid, prompt, params in requests:
        core.add_request(rid, prompt, params)
    out: dict[str, tuple[list[int], list[TokenLogprob]]] = {r: ([], []) for r, _, _ in requests}
    while core.has_work():
        for d in core.step():
            out[d.request_id][0].extend(d.token_ids)
            if d.logprobs is not None:
                out[d.request_id][1].extend(d.logprobs)
    return out


def test_logprobs_equal_log_softmax_of_the_reference_logits(tiny_cache_dir: Path,
                                                            tiny_model_dir: Path) -> None:
    parts = make(tiny_cache_dir)
    prompt = parts.tokenizer.encode("The river runs")
    asks = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True,
                          logprobs=5, presence_penalty=1.5, logit_bias=((7, 2.0),))
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = generate(parts, [("a", prompt, asks), ("b", prompt, plain)])
    tokens, lps = got["a"]
    assert len(lps) == len(tokens) == 8 and got["b"][1] == []
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir,
                                                           torch_dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
    ref = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)  # the raw distribution
    for i, (tok, lp) in enumerate(zip(tokens, lps)):
        assert lp.logprob == pytest.approx(ref[i, tok].item(), abs=1e-4)
        assert len(lp.top) == 5
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert [t for t, _ in lp.top] == ref[i].topk(5).indices.tolist()
        assert values == pytest.approx(ref[i].topk(5).values.tolist(), abs=1e-4)


def test_bias_and_penalties_change_the_engine_output(tiny_cache_dir: Path) -> None:
    parts = make(tiny_cache_dir)
    prompt = parts.tokenizer.encode("Once upon a time")
    greedy = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    forced = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                            logit_bias=((65, 100.0),))
    penalized = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True,
                               frequency_penalty=2.0, presence_penalty=2.0)
    got = generate(parts, [("g", prompt, greedy), ("f", prompt, forced),
                           ("p", prompt, penalized)])
    assert got["f"][0] == [65] * 4
    # strong penalties make greedy repeat itself less
    assert len(set(got["p"][0])) > len(set(got["g"][0]))
    alone = generate(make(tiny_cache_dir), [("p", prompt, penalized)])
    assert alone["p"][0] == got["p"][0]  # the same alone as in a batch
