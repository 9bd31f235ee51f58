"""Fixtures of the engine tests: the compiled CPU kernels."""

from __future__ import annotations

import os
from typing import Any, NoReturn

import pytest

from backend.engine.decode_kernel import DecodeKernel, cpu_flags, load_decode_kernel


def no_compiler() -> None:
    """Skip where there is no C compiler, but fail where CI requires the native code
    (SLUICE_REQUIRE_NATIVE, set by .ci/run): there a failed build must not pass unseen."""
    if os.environ.get("SLUICE_REQUIRE_NATIVE"):
        pytest.fail("the decode kernel did not build (SLUICE_REQUIRE_NATIVE is set)")
    pytest.skip("no C compiler: the engine falls back to torch ops")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> DecodeKernel:
    """The decode-attention kernel and the fused decode step, built into a fresh cache."""
    k = load_decode_kernel(tmp_path_factory.mktemp("kernels"))
    if k is None:
        no_compiler()
    return k


def cpu_has_avx2_fma() -> bool:
    flags = cpu_flags().split()
    return "avx2" in flags and "fma" in flags


def no_fused_step() -> NoReturn:
    """Skip where the CPU cannot run the fused decode steps (no AVX2 + FMA), fail where it
    can and CI requires the native code."""
    if os.environ.get("SLUICE_REQUIRE_NATIVE") and cpu_has_avx2_fma():
        pytest.fail("no fused decode step on an AVX2 CPU (SLUICE_REQUIRE_NATIVE is set)")
    pytest.skip("the fused decode step needs AVX2 + FMA")


def fused_or_skip(model: Any) -> Any:
    """The model's fused decode step, or ``no_fused_step``."""
    if model.fused is None:
        no_fused_step()
    return model.fused
