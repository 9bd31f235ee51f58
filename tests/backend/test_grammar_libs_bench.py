"""`python -m backend.bench.grammar_libs` end to end with only llguidance: the figures and
verdicts it promises, the engine's library never loosening a schema, and a library that
does not import reported with its pin rather than raised (speed is the bench's to show,
never asserted here)."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from backend.bench.grammar_libs import main
from backend.bench.grammar_probes import ENFORCED, IGNORED, OVER, PROBES, REFUSED, named_keywords

REPS = 2


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """One run: ``--libs llguidance,xgrammar --vocab 1k --reps 2`` with xgrammar's import
    made to fail (as where it is not installed)."""
    out = tmp_path_factory.mktemp("grammar") / "libs.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
        printed = io.StringIO()  # capsys is per test; this run is shared by the module
        with contextlib.redirect_stdout(printed):
            code = main(["--libs", "llguidance,xgrammar", "--vocab", "1k", "--reps", str(REPS),
                         "--json", str(out)])
    assert code == 0
    return json.loads(Path(out).read_text()), printed.getvalue()


def test_the_json_has_every_figure(bench: tuple[dict[str, Any], str]) -> None:
    result, printed = bench
    assert set(result) == {"vocab", "reps", "threads", "libraries", "mask", "batch",
                           "coverage", "silently_ignored"}
    assert result["vocab"]["name"] == "1k" and result["vocab"]["size"] == 1024
    llguidance = result["libraries"]["llguidance"]
    assert llguidance["installed"] and llguidance["version"]
    assert set(result["mask"]) == set(result["batch"]) == {"llguidance"}
    mask = result["mask"]["llguidance"]
    assert mask["samples"] == REPS * (mask["tokens"] + 1)  # every token, and the end
    assert 0 < mask["p50_us"] <= mask["p90_us"] <= mask["p99_us"] <= mask["max_us"]
    assert mask["first_mask_ms"] > 0
    batch = result["batch"]["llguidance"]
    assert batch["size"] == 32 and batch["api_name"]
    for kind in ("loop", "api"):
        assert 0 < batch[kind]["p50_us"] <= batch[kind]["p99_us"]
    assert [row["probe"] for row in result["coverage"]] == [p.name for p in PROBES]
    for heading in ("## Per-token mask", "## A batch of 32 masks", "## JSON Schema coverage"):
        assert heading in printed


def test_llguidance_never_silently_ignores_a_keyword(bench: tuple[dict[str, Any], str]) -> None:
    result, printed = bench
    verdicts = {row["probe"]: row["verdicts"]["llguidance"] for row in result["coverage"]}
    assert {v["verdict"] for v in verdicts.values()} <= {ENFORCED, REFUSED, OVER}
    assert not [name for name, v in verdicts.items() if v["verdict"] == IGNORED]
    assert result["silently_ignored"] == {"llguidance": 0}
    assert "SILENTLY IGNORED: llguidance 0/" in printed
    # both kinds occur: features it enforces, and features it refuses rather than loosen
    assert verdicts["pattern"]["verdict"] == ENFORCED
    assert verdicts["uniqueItems"]["verdict"] == REFUSED


def test_every_refusal_names_a_keyword_of_its_schema(bench: tuple[dict[str, Any], str]) -> None:
    result, _ = bench
    schemas = {p.name: json.dumps(p.schema) for p in PROBES}
    refused = [(row["probe"], row["verdicts"]["llguidance"]) for row in result["coverage"]
               if row["verdicts"]["llguidance"]["verdict"] == REFUSED]
    assert refused
    for probe, verdict in refused:
        assert verdict["keywords"], (probe, verdict["message"])
        assert all(f'"{k}"' in schemas[probe] for k in verdict["keywords"])
    by_probe = dict(refused)
    assert by_probe["uniqueItems"]["keywords"] == ["uniqueItems"]
    assert by_probe["if/then/else"]["keywords"] == ["if", "then", "else"]


def test_a_library_that_does_not_import_is_listed_with_its_pin(
        bench: tuple[dict[str, Any], str]) -> None:
    result, printed = bench
    assert result["libraries"]["xgrammar"] == {"installed": False, "pin": "xgrammar==0.2.9",
                                               "version": None}
    assert "- xgrammar: not installed: pip install xgrammar==0.2.9" in printed
    assert all(set(row["verdicts"]) == {"llguidance"} for row in result["coverage"])


def test_a_refusal_names_keywords_by_name_or_by_quoted_value() -> None:
    schema = {"type": "string", "pattern": "^(?!x)$", "format": "made-up"}
    assert named_keywords(schema, "regex parse error: ^(?!x)$ look-around") == ["pattern"]
    assert named_keywords(schema, "Unknown format: made-up") == ["format"]
    assert named_keywords(schema, "Failed to build DFA") == []
    assert named_keywords({"if": {}, "then": {}}, 'Unimplemented keys: ["if", "then"]') == [
        "if", "then"]
