"""Subcommands of the bundled model server (`sluice backend`, `sluice up`)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the backend's subcommands to the `sluice` parser."""
