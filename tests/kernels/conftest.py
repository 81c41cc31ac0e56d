"""Shared helpers for the kernel tests: the per-dtype tolerance table and a comparison helper.

Triton runs on CPU tensors only under its interpreter, and Triton reads TRITON_INTERPRET when it
is imported / when a kernel is launched, so the variable is set here, before any test module can
import triton. Import the helpers in a test module with

    from tests.kernels.conftest import DTYPE_TOL, assert_close_tol
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

# (atol, rtol) for comparing a fast path against its fp32-accumulating reference. bf16 keeps
# 8 mantissa bits (one rounding = 2**-8 relative), fp16 keeps 11; a fused kernel may round at
# different points than the eager reference, so allow a few roundings.
DTYPE_TOL: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1.3e-5),
    torch.bfloat16: (2e-2, 1.6e-2),
    torch.float16: (2e-3, 2e-3),
}

# Looser table for ops that reduce over long axes in a different order (attention, GEMMs).
REDUCTION_TOL: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (3e-3, 3e-3),
}

# Triton's CPU interpreter rounds fp32 -> bf16 toward zero (truncation) where a GPU rounds to
# nearest even, so each bf16 rounding inside an interpreted kernel can be one ulp (2**-7
# relative) further from the reference. Use this table for Triton kernels run under
# TRITON_INTERPRET=1 (fp32 / fp16 conversions are exact there).
INTERPRET_TOL: dict[torch.dtype, tuple[float, float]] = {
    **DTYPE_TOL,
    torch.bfloat16: (6e-2, 3e-2),
}


def assert_close_tol(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None,
                     table: dict[torch.dtype, tuple[float, float]] | None = None) -> None:
    """assert_close with the tolerance of `dtype` (default: ref's dtype) from `table`.

    Also checks shape and dtype equality and that `out` has no NaN where `ref` has none.
    """
    dtype = dtype or ref.dtype
    atol, rtol = (table or DTYPE_TOL)[dtype]
    assert out.shape == ref.shape, f"shape: got {tuple(out.shape)}, expected {tuple(ref.shape)}"
    assert out.dtype == ref.dtype, f"dtype: got {out.dtype}, expected {ref.dtype}"
    assert not (out.isnan() & ~ref.isnan()).any(), "output has NaN where the reference has none"
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def requires_triton():
    """pytest mark: skip (with a reason) when triton is not installed."""
    from hf_dsinfer.kernels._dispatch import triton_available

    return pytest.mark.skipif(not triton_available(), reason="triton is not installed")


@pytest.fixture
def triton_interpret(monkeypatch):
    """Make sure Triton kernels run under the CPU interpreter for this test."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def count_calls(monkeypatch, module, name: str) -> list[int]:
    """Wrap module.<name> for this test so each call appends to the returned list: the proof
    that a fast path ran, not only that its output matched."""
    calls: list[int] = []
    original = getattr(module, name)

    @functools.wraps(original)
    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def pin_crossovers(monkeypatch, tier: str | None = None, **bounds: int):
    """Give the row of `tier` (default: the running tier) in kernels/crossovers.py these bounds
    for this test, e.g. so that a test of a kernel's numerics runs it on every row count it
    checks, whatever the crossover measured for that tier. Returns the pinned row."""
    import dataclasses

    from hf_dsinfer.kernels import crossovers

    tier = tier or crossovers._native.tier()
    row = dataclasses.replace(crossovers.TABLE[tier], **bounds)
    monkeypatch.setitem(crossovers.TABLE, tier, row)
    return row
