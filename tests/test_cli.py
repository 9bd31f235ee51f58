"""The `sluice` command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sluice.cli import main


def test_tiny_model_command_writes_the_same_bytes_as_the_cache(tmp_path: Path,
                                                                tiny_model_dir: Path) -> None:
    out = tmp_path / "tiny"
    assert main(["tiny-model", "--out", str(out)]) == 0
    names = sorted(p.name for p in tiny_model_dir.iterdir())
    assert sorted(p.name for p in out.iterdir()) == names
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(names)
    for name in names:
        assert (out / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name


def test_unknown_command_fails_with_usage() -> None:
    proc = subprocess.run([sys.executable, "-m", "sluice.cli", "no-such-command"],
                          check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr


def test_backend_refuses_a_bad_thread_count(capsys) -> None:
    assert main(["backend", "--model", "tiny", "--threads", "0"]) == 2
    assert "num_threads must be >= 1" in capsys.readouterr().err
