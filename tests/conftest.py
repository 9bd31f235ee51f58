"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton kernels run on CPU tensors through Triton's interpreter (no GPU here): it is
# read when triton is first imported, so before any test module imports it.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory holding the tiny default model, built once per test session."""
    from modelfiles.tiny_model import ensure_tiny_model

    cache = tmp_path_factory.mktemp("sluice-cache")
    ensure_tiny_model(cache)
    return cache


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_cache_dir: Path) -> Path:
    from modelfiles.tiny_model import ensure_tiny_model

    return ensure_tiny_model(tiny_cache_dir)
