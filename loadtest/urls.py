"""The one spelling of a target's address the load tools work from."""

from __future__ import annotations


def server_root(url: str) -> str:
    """``http://host:port`` from a base URL given with or without ``/v1`` (and a slash)."""
    return url.rstrip("/").removesuffix("/v1")
