"""KV-cache int8 / 4-bit compression: quality bounds and Triton kernels against the reference.

SQNR bounds for Gaussian cache values (rounding noise variance step**2 / 12):
- int8 per head vector of 16: max|x| ~ 2.0 s, step = max / 127, SQNR ~ 46 dB; we require 40 dB.
- int4 min-max groups of 64: range ~ 4.7 s, step = range / 15, SQNR ~ 20.7 dB; groups of 16:
  range ~ 3.5 s, SQNR ~ 23 dB; we require 19 dB for both.
"""

from __future__ import annotations

import pytest
import torch

from hf_dsinfer.kernels import kv_quant as KV
from tests.kernels.conftest import assert_close_tol, requires_triton

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# [batch, kv heads, seq, head_dim]: 3 KV heads, 7 tokens, head_dim 16 / 64 / 128.
SHAPES = ((1, 3, 7, 16), (2, 3, 5, 64), (1, 2, 3, 128))


def sqnr_db(approx: torch.Tensor, exact: torch.Tensor) -> float:
    noise = (approx.double() - exact.double()).pow(2).mean()
    return float(10 * torch.log10(exact.double().pow(2).mean() / noise))


def _cache(shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)


def test_kv_int8_quality():
    x = _cache((2, 3, 64, 16))
    kv = KV.quantize_kv_int8(x)
    deq = KV.dequantize_kv_int8(kv)
    db, max_err = sqnr_db(deq, x), (deq - x).abs().max().item()
    print(f"kv int8: SQNR {db:.1f} dB, max |err| {max_err:.4f}")
    assert db >= 40.0 and ((deq - x).abs() <= kv.scales / 2 + 1e-6).all()


@pytest.mark.parametrize("head_dim,group", ((64, 64), (128, 64), (16, 16)))
def test_kv_int4_quality(head_dim, group):
    x = _cache((2, 3, 64, head_dim))
    kv = KV.quantize_kv_int4(x, group)
    assert kv.packed.shape[-1] == head_dim // 2 and kv.scales.dtype == torch.float16
    deq = KV.dequantize_kv_int4(kv, torch.float32)
    db, max_err = sqnr_db(deq, x), (deq - x).abs().max().item()
    print(f"kv int4 g{group}: SQNR {db:.1f} dB, max |err| {max_err:.4f}")
    assert db >= 19.0
    step = kv.scales.float().repeat_interleave(group, dim=-1)
    assert ((deq - x).abs() <= step / 2 + 1e-3 * x.abs()).all()  # + fp16 rounding of min


def test_kv_int4_rejects_bad_group():
    with pytest.raises(ValueError, match="divide head_dim"):
        KV.quantize_kv_int4(_cache((1, 1, 2, 48)), 64)


@requires_triton()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_kv_int8_triton_matches_ref(triton_interpret, dtype, shape):
    x = _cache(shape, dtype)
    got, ref = KV.quantize_kv_int8(x, backend="triton"), KV.quantize_kv_int8_ref(x)
    assert_close_tol(got.scales, ref.scales, dtype)
    assert (got.q.int() - ref.q.int()).abs().max() <= 1  # division order may flip a tie
    deq = KV.dequantize_kv_int8(ref, backend="triton")
    assert_close_tol(deq, KV.dequantize_kv_int8_ref(ref), dtype)


@requires_triton()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,group", ((SHAPES[0], 16), (SHAPES[1], 64), (SHAPES[2], 64)))
def test_kv_int4_triton_matches_ref(triton_interpret, dtype, shape, group):
    x = _cache(shape, dtype)
    got, ref = KV.quantize_kv_int4(x, group, backend="triton"), KV.quantize_kv_int4_ref(x, group)
    assert torch.equal(got.scales, ref.scales) and torch.equal(got.mins, ref.mins)
    diff = (got.packed & 0xF).int() - (ref.packed & 0xF).int()
    diff_hi = (got.packed >> 4).int() - (ref.packed >> 4).int()
    assert max(diff.abs().max(), diff_hi.abs().max()) <= 1
    for out_dtype in (torch.float16, dtype):
        deq = KV.dequantize_kv_int4(ref, out_dtype, backend="triton")
        assert_close_tol(deq, KV.dequantize_kv_int4_ref(ref, out_dtype), out_dtype)
