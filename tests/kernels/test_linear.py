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


def _count_fp32(monkeypatch, tier: str):
    """Run as `tier` (an x86 CPU); the fp32 GEMMs' call counter from 0."""
    monkeypatch.setattr(lin._native, "tier", lambda: tier)
    monkeypatch.setattr(lin, "_X86", True)
    monkeypatch.setattr(lin, "fp32_gemm_calls", 0)


@pytest.mark.parametrize("tier,fp32", (("generic", True), ("avx2", True), ("avx2_vnni", True),
                                       ("avx512", True), ("avx512_bf16", False), ("amx", False)))
@pytest.mark.parametrize("bias", (False, True))
def test_many_bf16_rows_run_as_fp32_gemms_where_the_cpu_lacks_bf16_dots(monkeypatch, tier, fp32,
                                                                        bias):
    """600 bf16 rows (past every native kernel's rows) at a tier without bf16 dot products run
    as fp32 GEMMs over chunks of the weight (exact bf16 -> fp32, one rounding after the bias:
    F.linear's numerics up to the order of the fp32 sums); with them (avx512_bf16, amx),
    F.linear. Chunks: 1100 output rows = 512 + 512 + 76."""
    _count_fp32(monkeypatch, tier)
    x, w, b = _inputs((2, 300), 96, 1100, torch.bfloat16, bias=bias)
    out = lin.linear(x, w, b, backend="auto")
    assert lin.fp32_gemm_calls == int(fp32)
    assert_close_tol(out, lin.linear_ref(x, w, b), torch.bfloat16, REDUCTION_TOL)
    # within one bf16 rounding of the fp32 product, as F.linear
    exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()


def test_fp32_gemms_start_at_their_row_count(monkeypatch):
    """Below FP32_GEMM_MIN_ROWS rows (where bf16 F.linear is as fast), or for fp32 / fp16 x,
    F.linear runs; from it, the fp32 GEMMs (native kernels off, so no panel takes the rows)."""
    switch(monkeypatch, native=False)
    _count_fp32(monkeypatch, "avx2")
    rows = lin.FP32_GEMM_MIN_ROWS
    x, w, b = _inputs((rows - 1,), 64, 40, torch.bfloat16)
    lin.linear(x, w, b, backend="auto")
    lin.linear(x.half(), w.half(), b.half(), backend="auto")
    assert lin.fp32_gemm_calls == 0
    x, w, b = _inputs((rows,), 64, 40, torch.bfloat16)
    out = lin.linear(x, w, b, backend="auto")
    lin.linear(x.float(), w.float(), b.float(), backend="auto")
    assert lin.fp32_gemm_calls == 1
    assert_close_tol(out, lin.linear_ref(x, w, b), torch.bfloat16, REDUCTION_TOL)


def test_fp32_gemms_not_on_arm(monkeypatch):
    """Off x86 (an Arm CPU's bf16 GEMMs are native there and were not measured) F.linear runs."""
    _count_fp32(monkeypatch, "generic")
    monkeypatch.setattr(lin, "_X86", False)
    x, w, b = _inputs((600,), 64, 40, torch.bfloat16)
    lin.linear(x, w, b, backend="auto")
    assert lin.fp32_gemm_calls == 0


@pytest.mark.parametrize("tier,named", (("avx2", True), ("avx512_bf16", False)))
def test_explain_says_where_many_bf16_rows_run_in_fp32(monkeypatch, tier, named):
    from tiny_models import make_model

    import hf_dsinfer

    _count_fp32(monkeypatch, tier)
    model = hf_dsinfer.init_inference(make_model("llama").to(torch.bfloat16), parity_check=False)
    text = hf_dsinfer.explain(model)
    assert ("fp32 GEMMs on weight chunks converted to fp32, since the avx2 tier has no bf16 dot "
            "products" in text) == named
