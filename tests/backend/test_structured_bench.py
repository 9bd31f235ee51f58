"""`python -m backend.bench.structured` end to end on the test model: every figure it
promises, and the cache hit rate the workload implies (performance is the bench's to
show, never asserted here)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from backend.bench.structured import TARGETS, main
from backend.engine.grammar_masks import Masker, MaskJob


def test_the_bench_reports_every_figure(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "structured.json"
    apply, forbidden = MaskJob.apply, Masker._forbidden
    threads = torch.get_num_threads()
    try:  # one thread: a multi-threaded step crawls on a machine busy with other tests
        assert main(["--model", "test", "--dtype", "float32", "--threads", "1",
                     "--rounds", "2", "--sentinel-runs", "1", "--batches", "1,2",
                     "--min-requests", "1", "--prompt", "8", "--compile-sizes", "2,8",
                     "--compile-schemas", "2", "--first-requests", "1",
                     "--cache-requests", "200", "--cache-schemas", "10",
                     "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    # the probes are the bench's, for its runs only
    assert (MaskJob.apply, Masker._forbidden) == (apply, forbidden)
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert set(result) == {"throughput", "mask", "compile", "cache", "details", "settings"}

    assert set(result["throughput"]) == set(result["mask"]) == {"1", "2"}
    for b, t in result["throughput"].items():
        assert len(t["round_ratios"]) == 2
        for key in ("tokens_per_s_ratio", "tokens_per_s", "free_tokens_per_s", "step_ms",
                    "free_step_ms"):
            assert math.isfinite(t[key]) and t[key] > 0, (b, key)
        assert t["requests"] == int(b)
        assert t["unconstrained_after_over_before"] > 0
        assert min(t["unconstrained_forward_ms_before"], t["unconstrained_forward_ms_after"]) > 0
        # the schema's instances are tens of tokens long, never the cap
        assert 20 <= t["output_tokens_min"] <= t["output_tokens_max"] < 400
        m = result["mask"][b]
        assert m["steps"] > 0 and 0 <= m["ready_before_forward_end"] <= 1
        for part in ("engine", "compute", "wait", "apply"):
            p50, p99 = m[f"{part}_ms_p50"], m[f"{part}_ms_p99"]
            assert 0 <= p50 <= p99 and math.isfinite(p99), (b, part)
        # the engine's figure runs from the job's start to its application: it spans the
        # worker's compute
        assert m["engine_ms_p50"] >= m["compute_ms_p50"]

    c = result["compile"]
    assert c["schemas"] == 4 and set(c["compile_ms_p50_by_properties"]) == {"2", "8"}
    assert 0 < c["compile_ms_p50"] <= c["compile_ms_p99"]
    for key in ("first_request_ttft_ms", "cached_schema_ttft_ms", "free_ttft_ms"):
        assert c[key] > 0

    h = result["cache"]
    assert (h["requests"], h["distinct_schemas"]) == (200, 10)
    assert (h["compiles"], h["cache_hits"]) == (10, 190)
    assert h["hit_rate"] == (h["requests"] - h["distinct_schemas"]) / h["requests"] == 0.95

    assert result["details"]["targets"] == TARGETS
    assert "hit rate 0.950" in table and "compile (check + first mask)" in table
    assert sum(line.split()[0] in ("1", "2") for line in table.splitlines()
               if line.strip()) == 6  # a throughput, an unconstrained and a mask row per batch
