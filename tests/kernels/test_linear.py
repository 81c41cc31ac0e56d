"""linear: Triton GEMV / GEMM kernels and the CPU fast path against F.linear, on odd shapes."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from hf_dsinfer.kernels import linear as lin
from tests.kernels.conftest import REDUCTION_TOL, assert_close_tol, requires_triton
from tests.switches import switch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (leading shape of x, in, out): 1 row (GEMV), 3 rows (GEMV), 7 and 2x5 rows (tiled GEMM).
SHAPES = (((1,), 80, 48), ((3,), 80, 37), ((7,), 80, 72), ((2, 5), 33, 70))


def _inputs(lead, k, n, dtype, conv1d_layout=False, bias=True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*lead, k, generator=g).to(dtype)
    if conv1d_layout:  # GPT-2 Conv1D stores [in, out]; the caller passes the .t() view
        weight = torch.randn(k, n, generator=g).to(dtype).t()
    else:
        weight = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, weight, b


@requires_triton()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,k,n", SHAPES)
@pytest.mark.parametrize("conv1d_layout", (False, True))
def test_linear_triton_matches_ref(triton_interpret, dtype, lead, k, n, conv1d_layout):
    x, w, b = _inputs(lead, k, n, dtype, conv1d_layout, bias=len(lead) == 1)
    out = lin.linear(x, w, b, backend="triton")
    assert_close_tol(out, lin.linear_ref(x, w, b), dtype, REDUCTION_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,k,n", SHAPES + (((1, 1), 80, 48),))
@pytest.mark.parametrize("conv1d_layout", (False, True))
@pytest.mark.parametrize("bias", (False, True))
def test_linear_cpu_matches_ref(dtype, lead, k, n, conv1d_layout, bias):
    x, w, b = _inputs(lead, k, n, dtype, conv1d_layout, bias)
    out = lin.linear(x, w, b, backend="cpu")
    assert_close_tol(out, lin.linear_ref(x, w, b), dtype, REDUCTION_TOL)


def test_linear_cpu_uses_mv_only_where_it_wins(monkeypatch):
    """Without the native bf16 GEMV (tests/kernels/test_bf16_gemv.py), one bf16 row on a
    row-major weight goes to torch.mv; other cases go to F.linear."""
    switch(monkeypatch, native=False)
    x, w, b = _inputs((1, 1), 80, 48, torch.bfloat16)
    with mock.patch.object(lin.torch, "addmv", wraps=torch.addmv) as addmv:
        lin.linear(x, w, b, backend="auto")
        lin.linear(x, w.t().contiguous().t(), b, backend="auto")  # column-major: F.linear
        lin.linear(x.float(), w.float(), b.float(), backend="auto")  # fp32: F.linear
        lin.linear(torch.cat([x, x], 1), w, b, backend="auto")  # 2 rows: F.linear
    assert addmv.call_count == 1


def test_linear_does_not_copy_a_transposed_weight():
    x, w, _ = _inputs((3,), 80, 48, torch.float32, conv1d_layout=True)
    with mock.patch.object(torch.Tensor, "contiguous", side_effect=AssertionError("copied")):
        lin.linear(x, w, backend="cpu")
