"""How the overhead bench prints: one flushed line at a time, target verdicts, ratios."""

from __future__ import annotations

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
