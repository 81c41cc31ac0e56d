"""The native panel kernels (csrc/cpu_qgemm.c: hfd_int4_gemm_bf16 and hfd_int8_gemm_bf16, via
kernels/quant.py): many rows of x (batched decode, continuous batching's packed steps) times a
4-bit or int8 weight dequantized in cache, a panel of rows at a time.

Their dequantization must be quant.py's (dequantize_int4 / dequantize_int8 to bf16) bit for
bit, their products F.linear's on that weight up to the order of the fp32 sums, the result
independent of the rows around a row, the thread count and the ISA tier, and linear_int4 /
linear_int8 must call them for the rows their crossovers give them (counted), not for others.
"""

from __future__ import annotations

import pytest
import torch
from switches import switch

from hf_dsinfer.kernels import _native, crossovers
from hf_dsinfer.kernels import quant as Q
from tests.kernels.conftest import count_calls, pin_crossovers

pytestmark = [pytest.mark.skipif(not _native.builds(),
               reason=f"native CPU kernels unavailable: {_native.why_unavailable()}"),
              pytest.mark.usefixtures("native_tier")]


def _gaussian(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _weight(n, k, group, s_dt=torch.bfloat16, portable=False, seed=0):
    w = (_gaussian(n, k, seed=seed) * 0.05).to(s_dt)
    return Q.quantize_int4(w, group, portable=portable)


# (n, k, group, portable): tiles with whole 512-column runs and a rest (1152), tiles without a
# run (384), row-major codes (portable: the offload engine's), a row-major weight whose row is
# not whole tiles (96 columns), and 144 rows of 2048 columns: a full panel of 128 rows and a
# last one of 16
SHAPES = [(48, 1152, 32, False), (32, 384, 128, False), (16, 1024, 256, True),
          (64, 512, 64, True), (16, 96, 32, False), (144, 2048, 32, False)]


@pytest.mark.parametrize("s_dt", (torch.bfloat16, torch.float32, torch.float16))
@pytest.mark.parametrize("n,k,group,portable", SHAPES)
def test_dequantization_is_quants_to_the_bit(n, k, group, portable, s_dt):
    """x = the identity (one-hot rows): each output is one exact product, so y.T is the
    dequantized weight the kernel multiplied by, which must equal dequantize_int4(W, bf16)."""
    qw = _weight(n, k, group, s_dt, portable)
    assert qw.tiled == (not portable and n % 4 == 0 and k % 128 == 0)
    y = Q._native_int4_gemm(torch.eye(k, dtype=torch.bfloat16), qw)
    assert y is not None and y.dtype == torch.float32
    assert torch.equal(y.t(), Q.dequantize_int4(qw, torch.bfloat16).float())


def _extreme_weight():
    """Groups of zeros, of tiny weights (mins under 2^-100: such a row takes the exact rounding,
    not vcvtne2ps2bf16, which flushes denormals), of huge ones, and ordinary ones."""
    w = _gaussian(64, 512, seed=3) * 0.05
    w[0:4, 0:32] = 0.0                   # a group of zeros (scale 0, min 0)
    w[4:8, 32:64] *= 1e-36               # scales ~1e-38 (bf16 keeps them; fp32 products denormal)
    w[8:12, 64:96] *= 1e-33
    w[12:16, 96:128] *= 1e30             # large but finite
    w[16:20, 0:32] = 1e-36               # a constant group: min 1e-36, the values the min
    return Q.quantize_int4(w.bfloat16(), 32)


def test_dequantization_of_extreme_groups_is_quants_to_the_bit():
    """The extreme groups above, dequantized by the panel kernel: quant.py's values, bit for
    bit (one-hot rows of x: each output is one weight). Denormal weights themselves cannot be
    seen so: the bf16 products treat denormal inputs as zero (DAZ)."""
    qw = _extreme_weight()
    y = Q._native_int4_gemm(torch.eye(512, dtype=torch.bfloat16), qw)
    assert y is not None
    assert torch.equal(y.t().bfloat16(), Q.dequantize_int4(qw, torch.bfloat16))


@pytest.mark.amx
@pytest.mark.skipif(not _native.amx_available(), reason="needs a CPU that grants AMX tiles")
def test_amx_dequantization_of_extreme_groups_is_quants_to_the_bit():
    """The same through the AMX int4 kernel (csrc/cpu_moe.c: hfd_int4_amx), 128 rows a call."""
    qw = _extreme_weight()
    eye = torch.eye(512, dtype=torch.bfloat16)
    y = torch.cat([Q._native_int4_amx(eye[i:i + 128], qw) for i in range(0, 512, 128)])
    assert torch.equal(y.t(), Q.dequantize_int4(qw, torch.bfloat16))


@pytest.mark.parametrize("n,k,group,portable", SHAPES)
@pytest.mark.parametrize("rows", (1, 5, 6, 13))
def test_products_within_the_fp32_sum_bound(n, k, group, portable, rows):
    """Random x (groups spanning 4 decades) against float64 on the bf16 weight: within the
    worst case of any order of fp32 sums, (k - 1) * 2^-24 * sum |x w| per output."""
    qw = _weight(n, k, group, portable=portable)
    x = _gaussian(rows, k, seed=1)
    x[:, ::7] *= 100.0
    x = x.bfloat16()
    y = Q._native_int4_gemm(x, qw)
    w = Q.dequantize_int4(qw, torch.bfloat16).double()
    ref = x.double() @ w.t()
    bound = (k - 1) * 2.0**-24 * (x.double().abs() @ w.abs().t())
    assert ((y.double() - ref).abs() <= bound).all()


def test_a_row_does_not_depend_on_its_batch_or_the_threads():
    """13 rows at once, each row alone, and 1 thread against 2 (144 weight rows: one panel of
    128 and one of 16, or two of 80 and 64): the same bits (each output is summed the same way
    wherever its row falls in the register blocks and its weight row in the panels)."""
    qw = _weight(144, 2048, 32)
    x = _gaussian(13, 2048, seed=3).bfloat16()
    many = Q._native_int4_gemm(x, qw)
    alone = torch.cat([Q._native_int4_gemm(x[i:i + 1], qw) for i in range(13)])
    assert torch.equal(many, alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = Q._native_int4_gemm(x, qw)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(many, one)


def test_every_tier_computes_the_same_bits(monkeypatch):
    """The tiers below avx512_bf16 emulate vdpbf16ps and the word permute (hfd_simd.h): the
    same bits at every tier this CPU has, for both kernels."""
    qw = _weight(32, 384, 64)
    q8 = Q.quantize_int8((_gaussian(32, 384, seed=5) * 0.05).bfloat16())
    x = _gaussian(7, 384, seed=4).bfloat16()
    outs = {}
    for tier in _native.runnable_tiers():
        switch(monkeypatch, isa=tier)
        outs[tier] = torch.cat([Q._native_int4_gemm(x, qw), Q._native_int8_gemm(x, q8)])
    first = next(iter(outs.values()))
    assert all(torch.equal(first, out) for out in outs.values()), list(outs)


def test_shapes_it_does_not_take_fall_back():
    """out % 16 != 0 or x not bf16: None (the caller's other paths)."""
    assert Q._native_int4_gemm(torch.ones(3, 256, dtype=torch.bfloat16), _weight(20, 256, 32)) \
        is None
    assert Q._native_int4_gemm(torch.ones(3, 256), _weight(16, 256, 32)) is None


@pytest.mark.parametrize("rows", (9, 40))
def test_linear_int4_runs_it_for_its_rows(monkeypatch, rows):
    """linear_int4 on the CPU takes the panel kernel from int4_native_max_rows + 1 to
    int4_gemm_max_rows bf16 rows (pinned here, whatever the tier measured): counted, its result
    rounded to bf16 and the bias added after; an fp32 x and more rows go elsewhere."""
    pin_crossovers(monkeypatch, int4_native_max_rows=8, int4_gemm_max_rows=40)
    calls = count_calls(monkeypatch, Q, "_native_int4_gemm")
    native = count_calls(monkeypatch, Q, "_native_int4")
    qw = _weight(48, 1152, 32)
    x = _gaussian(rows, 1152, seed=5).bfloat16()
    bias = _gaussian(48, seed=6).bfloat16()
    out = Q.linear_int4(x, qw, bias, backend="cpu")
    assert len(calls) == 1 and not native
    want = Q._native_int4_gemm(x, qw).to(torch.bfloat16) + bias
    assert torch.equal(out, want)
    Q.linear_int4(x.float(), qw, backend="cpu")  # fp32 x: asked, declines
    Q.linear_int4(_gaussian(41, 1152).bfloat16(), qw, backend="cpu")  # past its bound: not asked
    assert len(calls) == 3  # with the call that made `want`
    amx = crossovers.rows().amx_int4_max_rows if _native.amx_available() else None
    assert crossovers.rows().int4_codes_max_rows(torch.bfloat16) == max(40, amx or 0)
    assert crossovers.rows().int4_codes_max_rows(torch.float32) == 8


# (n, k, equalize): tiles (k % 64 == 0) and row-major rows (96 columns), with an input scale
INT8_SHAPES = [(48, 1152, False), (32, 96, False), (144, 2048, True)]


@pytest.mark.parametrize("s_dt", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("n,k,equalize", INT8_SHAPES)
def test_int8_dequantization_is_quants_to_the_bit(n, k, equalize, s_dt):
    """As for 4 bits: x = the identity gives the weight the kernel multiplied by, q * s rounded
    to bf16 (the input scale is the caller's, folded into x as the chunked path does)."""
    qw = Q.quantize_int8((_gaussian(n, k) * 0.05).to(s_dt), equalize=equalize)
    assert qw.tiled == (k % 64 == 0)
    plain = qw._replace(in_scale=None)
    y = Q._native_int8_gemm(torch.eye(k, dtype=torch.bfloat16), plain)
    assert torch.equal(y.t(), Q.dequantize_int8(plain, torch.bfloat16).float())
    assert Q._native_int8_gemm(torch.eye(k, dtype=torch.bfloat16), qw) is None or not equalize


@pytest.mark.parametrize("n,k,equalize", INT8_SHAPES)
@pytest.mark.parametrize("rows", (1, 7, 25))
def test_int8_products_and_dispatch(monkeypatch, n, k, equalize, rows):
    """linear_int8 takes the panel kernel past the GEMV's rows (bounds pinned: GEMV 0 rows; AMX
    off),
    counted; against float64 on the bf16 weight of (x * in_scale) rounded to bf16, as the
    chunked path folds it: within the fp32 sum bound, then one bf16 rounding and the bias."""
    switch(monkeypatch, amx=False)  # an AMX CPU's int8 tiles would take these rows first
    pin_crossovers(monkeypatch, int8_gemv_max_rows=0, int8_gemm_max_rows=25)
    calls = count_calls(monkeypatch, Q, "_native_int8_gemm")
    qw = Q.quantize_int8((_gaussian(n, k) * 0.05).bfloat16(), equalize=equalize)
    x = _gaussian(rows, k, seed=1).bfloat16()
    bias = _gaussian(n, seed=2).bfloat16()
    out = Q.linear_int8(x, qw, bias, backend="cpu")
    assert len(calls) == 1
    x2, plain = Q._fold_in_scale(x, qw)
    w = Q.dequantize_int8(plain, torch.bfloat16).double()
    ref = x2.double() @ w.t()
    bound = (k - 1) * 2.0**-24 * (x2.double().abs() @ w.abs().t())
    y = Q._native_int8_gemm(x2, plain)
    assert ((y.double() - ref).abs() <= bound).all()
    assert torch.equal(out, y.to(torch.bfloat16) + bias)
