"""A quantized engine end to end on the tiny model: output quality against the
unquantized engine, logprobs, the versions and prefix-cache salt that tell the three apart,
the weight bytes in the state, and a bad ``quantization`` refused clearly."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import pytest
import torch

from backend.bench.quant import decode_batch
from backend.engine.builder import EngineParts, build_engine
from backend.engine.config import EngineConfig
from backend.engine.errors import InvalidRequestError
from backend.engine.outputs import OutputDelta
from backend.engine.sampling import SamplingParams
from backend.engine.versions import engine_version, kv_features, prefix_cache_salt

NAMES = (None, "int8", "int4")


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str | None, EngineParts]]:
    yield {q: build_engine(EngineConfig(model="tiny", dtype="bfloat16", quantization=q,
                                        kv_blocks=128)) for q in NAMES}


def _prompts(n: int = 8, length: int = 12) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return torch.randint(3, 500, (n, length), generator=gen).tolist()


def _serve(parts: EngineParts, params: SamplingParams) -> dict[str, list[OutputDelta]]:
    core = parts.core
    for i, prompt in enumerate(_prompts()):
        core.add_request(f"r{i}", prompt, params)
    out: dict[str, list[OutputDelta]] = {}
    while core.has_work():
        for d in core.step():
            out.setdefault(d.request_id, []).append(d)
    return out


def test_int8_next_token_distributions_stay_close(
        engines: dict[str | None, EngineParts]) -> None:
    """Teacher-forced on the unquantized engine's greedy tokens, through the decode path
    (8 sequences a step: the fused C step): int8 KL mean <= 0.01 and top-1 >= 0.9; int4
    is coarser (its KL is higher), and both sequences agree with the reference a while."""
    prompts = _prompts()
    ref_logits, ref_tokens = decode_batch(engines[None], prompts, 16)
    kl, top1, agree = {}, {}, {}
    for q in ("int8", "int4"):
        logits, _ = decode_batch(engines[q], prompts, 16, forced=ref_tokens)
        p, lq = ref_logits.log_softmax(-1), logits.log_softmax(-1)
        kl[q] = float((p.exp() * (p - lq)).sum(-1).mean())
        top1[q] = float((p.argmax(-1) == lq.argmax(-1)).float().mean())
        _, own = decode_batch(engines[q], prompts, 16)
        agree[q] = sum(int(((a != b).cumsum(0) == 0).sum())
                       for a, b in zip(ref_tokens, own, strict=True)) / len(prompts)
    assert kl["int8"] <= 0.01 and top1["int8"] >= 0.9, (kl, top1)
    assert kl["int4"] > kl["int8"] and math.isfinite(kl["int4"])
    assert agree["int8"] >= 8, agree  # of 16 greedy tokens, on average


def test_greedy_and_logprobs_through_the_engine(
        engines: dict[str | None, EngineParts]) -> None:
    """The engine's own greedy requests with logprobs: int8 reports the same first token as
    the unquantized engine for most prompts, with logprobs close to its (the tiny model's
    64-wide rows quantize coarsely: 0.02 apart on average, 0.09 at most, when measured);
    each token's top logprobs are sorted, finite, and start with the token itself."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    ref, got = _serve(engines[None], params), _serve(engines["int8"], params)
    diffs = []
    for rid, deltas in got.items():
        tokens = [t for d in deltas for t in d.token_ids]
        lps = [lp for d in deltas for lp in d.logprobs or ()]
        assert len(tokens) == len(lps) == 6
        for token, lp in zip(tokens, lps, strict=True):
            values = [v for _, v in lp.top]
            assert values == sorted(values, reverse=True) and all(map(math.isfinite, values))
            assert lp.logprob == pytest.approx(values[0], abs=1e-5)  # greedy: the top one
            assert lp.top[0][0] == token
        ref_first = ref[rid][0]
        if ref_first.token_ids[0] == tokens[0] and ref_first.logprobs is not None:
            diffs.append(abs(lps[0].logprob - ref_first.logprobs[0].logprob))
    assert len(diffs) >= 6 and sum(diffs) / len(diffs) <= 0.05 and max(diffs) <= 0.2, diffs


def test_seeded_sampling_is_reproducible_when_quantized(
        engines: dict[str | None, EngineParts]) -> None:
    params = SamplingParams(max_tokens=5, temperature=0.8, top_p=0.95, seed=3,
                            ignore_eos=True)
    runs = [_serve(engines["int4"], params) for _ in range(2)]
    tokens = [{rid: [t for d in ds for t in d.token_ids] for rid, ds in r.items()}
              for r in runs]
    assert tokens[0] == tokens[1] and all(len(t) == 5 for t in tokens[0].values())


def test_versions_and_prefix_cache_salt_tell_the_formats_apart(
        engines: dict[str | None, EngineParts]) -> None:
    versions = {q: engines[q].versions for q in NAMES}
    assert versions[None].versions.engine == engine_version()
    assert versions["int8"].versions.engine == engine_version("int8")
    assert versions["int4"].versions.engine.endswith("+int4")
    assert "engine=sluice-engine/" in versions["int8"].header_value()
    assert "+int8" in versions["int8"].header_value()
    assert len({v.fingerprint() for v in versions.values()}) == 3  # a pin tells them apart
    for salt in (None, "tenant-a"):
        assert len({prefix_cache_salt(v, salt) for v in versions.values()}) == 3
    # unquantized: the root is what it was before quantization existed
    base = versions[None]
    assert prefix_cache_salt(base, "s") == prefix_cache_salt(
        dataclasses.replace(base, versions=dataclasses.replace(
            base.versions, engine="sluice-engine/9+spec-ngram-k4-b8")), "s")
    assert kv_features("sluice-engine/0.1.0+int4+spec-ngram-k4-b8") == ("int4",)
    assert kv_features("sluice-engine/0.1.0") == ()


def test_state_reports_the_weight_bytes(engines: dict[str | None, EngineParts]) -> None:
    held = {q: engines[q].core.state().weight_bytes for q in NAMES}
    assert held[None] > 2 * held["int8"] > 0 and held["int8"] > held["int4"] > 0
    assert engines["int8"].core.state().as_dict()["weight_bytes"] == held["int8"]
    model = engines["int8"].runner.model
    assert held["int8"] == model.weight_bytes()


def test_unknown_quantization_is_refused_clearly() -> None:
    with pytest.raises(InvalidRequestError, match=r"unknown quantization 'int3'.*int8, int4") \
            as err:
        EngineConfig(quantization="int3")
    assert err.value.param == "quantization"


def test_the_cli_refuses_an_unknown_quantization(capsys: pytest.CaptureFixture[str]) -> None:
    from sluice.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["backend", "--model", "tiny", "--quantization", "fp3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--quantization" in err and "'int8', 'int4'" in err
