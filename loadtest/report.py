"""How the overhead bench prints: one flushed line at a time, target verdicts, ratios."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any


def say(line: str) -> None:
    print(line, flush=True)


def verdict(label: str, value: float | None, ok: bool | None) -> dict[str, Any]:
    shown = "-" if value is None else f"{value:.3g}"
    mark = "n/a" if ok is None else ("PASS" if ok else "MISS")
    say(f"  {label:<56} {shown:>10}  {mark}")
    return {"label": label, "value": value, "pass": ok}


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def run_bench(name: str, bench: Callable[[Path, contextlib.ExitStack], Awaitable[Any]]
              ) -> tuple[int, Any]:
    """Run ``bench(workdir, stack)`` on uvloop (when installed) in a temporary directory;
    every server it registers on ``stack`` is stopped however it ends. Returns (exit
    status, report); a server that did not start is 1, an interrupt 130."""
    from loadtest.targets import TargetError

    try:
        import uvloop
    except ImportError:  # the default loop works, with more client overhead
        run: Any = asyncio.run
    else:
        run = uvloop.run
    # Ctrl-C, SIGINT and SIGTERM all stop the servers: a shell starts a background job with
    # SIGINT ignored, and SIGTERM would otherwise end the bench without its cleanup.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: signal.raise_signal(signal.SIGINT))
    with tempfile.TemporaryDirectory(prefix=f"sluice-{name}-") as tmp, \
            contextlib.ExitStack() as stack:
        try:
            return 0, run(bench(Path(tmp), stack))
        except TargetError as exc:
            print(f"{name} bench: a server did not start: {exc}", file=sys.stderr)
            return 1, None
        except KeyboardInterrupt:
            print(f"{name} bench: interrupted; servers stopped", file=sys.stderr)
            return 130, None


def write_report(path: Path | None, report: Any) -> None:
    """``--json FILE``: every figure of the run, as JSON."""
    if path is not None:
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        say(f"wrote {path}")
