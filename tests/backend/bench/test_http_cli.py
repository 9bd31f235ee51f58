"""``python -m backend.bench.http``'s command line: ``--help`` prints usage and exits at once
(it used to read only ``--quick`` from argv and start the benchmark whatever was asked)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]


def bench_cli(*args: str) -> subprocess.CompletedProcess[str]:
    # The timeout is a hang guard, not a performance assert: the benchmark itself takes minutes.
    return subprocess.run([sys.executable, "-m", "backend.bench.http", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60, check=False)


def test_help_prints_usage_and_exits_0() -> None:
    done = bench_cli("--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m backend.bench.http [-h] [--quick]")
    assert "--quick" in done.stdout and "http_over_direct_tokens_per_s" in done.stdout


def test_an_unknown_flag_is_a_usage_error_not_a_run() -> None:
    done = bench_cli("--quik")
    assert done.returncode == 2 and "unrecognized arguments: --quik" in done.stderr
