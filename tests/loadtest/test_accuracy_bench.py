"""`python -m loadtest.accuracy` in a small configuration: every answer paired with the
scripted server's log, and each figure what its definition says (nothing timed)."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest import accuracy
from loadtest import scripted_server as script


def test_accuracy_pairs_every_answer_with_the_servers_log(tmp_path: Path, capsys: object
                                                          ) -> None:
    out = tmp_path / "acc.json"
    assert accuracy.main(["--rates", "5", "--duration", "1", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 1
    run = runs[0]
    served = run["outcomes"]["success"] + run["outcomes"]["slo_miss"]
    assert served == 5 and run["answers"] == served and run["unpaired"] == 0
    m = run["metrics"]
    # one chunk arrival per content event of every answer
    assert m["chunk_arrival_ms"]["n"] == served * (1 + script.CHUNKS)
    for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert m[name]["n"] == served
    for name in ("ttft_ms", "e2e_ms"):
        # timed from the read, the server's writes never beat the script (its sleeps to
        # absolute deadlines end late, never early); TPOT may (a late first chunk)
        assert m[name]["server_p50"] >= m[name]["nominal"] - 1e-3, name
    assert "ttft_ms" in capsys.readouterr().out  # type: ignore[attr-defined]
