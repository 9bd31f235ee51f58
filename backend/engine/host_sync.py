"""A test hook: count the reads of tensor values into Python while some code runs.

On a GPU each such read (``.item()``, ``.tolist()``, ``.cpu()``, ``bool(t)``, ``int(t)``, ...)
waits for every kernel queued before it: a host sync. The engine's device step is meant to
make one, the copy of the picked ids, and a CPU test holds it to that with this counter
(on the CPU the same calls are cheap, but they are the same calls). On a GPU
``torch.cuda.set_sync_debug_mode`` says the same thing from the driver's side
(``backend/bench/gpu_check.py``).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

# Tensor methods that hand a tensor's values to Python (or to host memory).
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextmanager
def count_host_syncs() -> Iterator[list[str]]:
    """While the block runs, every call of ``READS`` on a tensor is appended to the list
    it yields, as ``"name at file:line"`` of the calling line."""
    calls: list[str] = []
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            frame = traceback.extract_stack(limit=2)[0]
            calls.append(f"{name} at {frame.filename}:{frame.lineno}")
            return fn(self, *args, **kwargs)
        return wrapper

    for name, fn in saved.items():
        setattr(torch.Tensor, name, counted(name, fn))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
