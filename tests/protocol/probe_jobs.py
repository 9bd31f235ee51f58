"""Jobs for pool workers that import nothing of Sluice's themselves."""

from __future__ import annotations

import sys
import time


def loaded_after(seconds: float) -> tuple[bool, int]:
    """Whether the worker has imported ``protocol.large_bodies``, after ``seconds``."""
    time.sleep(seconds)
    return "protocol.large_bodies" in sys.modules, 0
