"""Weight-only int8 / int4 quantization: quality bounds (SQNR, max error) and every backend
against the dequantize + F.linear reference.

SQNR bounds, for Gaussian weights of std s (uniform rounding noise of variance step**2 / 12):
- int8 per channel, rows of 1024: step = max|w| / 127 ~ 3.4 s / 127, noise ~ 6e-5 s**2, so
  SQNR ~ 42 dB; we require >= 38 dB.
- int4 asymmetric, group 64 (128): the range of 64 (128) Gaussians is ~4.7 s (5.2 s), step =
  range / 15, so SQNR ~ 20.7 dB (20 dB); we require >= 18 dB.
- int4 symmetric, group 64: step = absmax / 7 ~ 2.6 s / 7, SQNR ~ 19.4 dB; we require >= 17 dB.
The output of a linear sums independent weight errors, so its SQNR is about the weight's: the
same bounds apply to y = x @ W.T against fp32.
"""

from __future__ import annotations

import pytest
import torch

from hf_dsinfer.kernels import quant as Q
from tests.kernels.conftest import REDUCTION_TOL, assert_close_tol, pin_crossovers, requires_triton

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The reference rounds each dequantized weight to x.dtype before F.linear; the fused kernels
# keep it in fp32 (Triton) or round a different value (torch's int4 CPU kernel takes
# zero = min + 8 * scale rounded to x.dtype). In fp16 each weight may thus differ by about an
# fp16 ulp of |zero| or |w|; summed over K that can exceed the fp16 GEMM tolerance (not bf16's).
DEQUANT_TOL = {**REDUCTION_TOL, torch.float16: REDUCTION_TOL[torch.bfloat16]}
INT4_CASES = ((64, False, 18.0), (128, False, 18.0), (64, True, 17.0), (128, True, 17.0))


def sqnr_db(approx: torch.Tensor, exact: torch.Tensor) -> float:
    exact = exact.double()
    noise = (approx.double() - exact).pow(2).mean()
    return float(10 * torch.log10(exact.pow(2).mean() / noise))


def _gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_int8_quality():
    w, x = _gaussian(256, 1024), _gaussian(4, 1024, seed=1)
    qw = Q.quantize_int8(w)
    deq = Q.dequantize_int8(qw)
    max_err = (deq - w).abs().max().item()
    w_db, y_db = sqnr_db(deq, w), sqnr_db(Q.linear_int8(x, qw), x @ w.T)
    print(f"int8: weight SQNR {w_db:.1f} dB, output SQNR {y_db:.1f} dB, max |err| {max_err:.4f}")
    assert w_db >= 38.0 and y_db >= 38.0
    # Rounding to the nearest step: never more than half a step per element.
    assert ((deq - w).abs() <= qw.scales[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("group_size,symmetric,bound_db", INT4_CASES)
def test_int4_quality(group_size, symmetric, bound_db):
    w, x = _gaussian(256, 1024), _gaussian(4, 1024, seed=1)
    qw = Q.quantize_int4(w, group_size, symmetric)
    deq = Q.dequantize_int4(qw)
    max_err = (deq - w).abs().max().item()
    w_db, y_db = sqnr_db(deq, w), sqnr_db(Q.linear_int4(x, qw), x @ w.T)
    print(f"int4 g{group_size} sym={symmetric}: weight SQNR {w_db:.1f} dB, "
          f"output SQNR {y_db:.1f} dB, max |err| {max_err:.4f}")
    assert w_db >= bound_db and y_db >= bound_db
    step = qw.scales.repeat_interleave(group_size, dim=1)  # [out, in]
    assert ((deq - w).abs() <= step / 2 + 1e-6).all()


def test_int4_pack_roundtrip_and_bad_group():
    q = torch.randint(0, 16, (5, 12), dtype=torch.uint8)
    assert torch.equal(Q.unpack_int4(Q.pack_int4(q)), q)
    with pytest.raises(ValueError, match="group_size"):
        Q.quantize_int4(torch.randn(16, 96), group_size=64)


@requires_triton()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k,n", ((1, 80, 37), (7, 80, 72)))
def test_linear_int8_triton_matches_ref(triton_interpret, dtype, rows, k, n):
    qw = Q.quantize_int8(_gaussian(n, k).to(dtype))
    x, bias = _gaussian(rows, k, seed=1).to(dtype), _gaussian(n, seed=2).to(dtype)
    out = Q.linear_int8(x, qw, bias, backend="triton")
    assert_close_tol(out, Q.linear_int8_ref(x, qw, bias), dtype, DEQUANT_TOL)


@requires_triton()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k,n,group,sym", ((1, 128, 37, 64, False), (7, 96, 48, 32, True)))
def test_linear_int4_triton_matches_ref(triton_interpret, dtype, rows, k, n, group, sym):
    qw = Q.quantize_int4(_gaussian(n, k).to(dtype), group, sym)
    x, bias = _gaussian(rows, k, seed=1).to(dtype), _gaussian(n, seed=2).to(dtype)
    out = Q.linear_int4(x, qw, bias, backend="triton")
    assert_close_tol(out, Q.linear_int4_ref(x, qw, bias), dtype, DEQUANT_TOL)


def _chunked_past(monkeypatch, rows: int) -> None:
    """Every CPU kernel's bound of the running tier below `rows`: they go to the chunked
    dequantize + GEMM path (the avx2 tier's measured bounds reach 64-512 rows)."""
    pin_crossovers(monkeypatch, int8_gemv_max_rows=rows // 2, int8_pack_max_rows=rows // 2,
                   int8_gemm_max_rows=None, int4_native_max_rows=rows // 2,
                   int4_pack_max_rows=rows // 2, int4_gemm_max_rows=None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead", ((1,), (2, 3), (40,)))  # 40 rows: the chunked path (pinned)
def test_linear_int8_cpu_matches_ref(monkeypatch, dtype, lead):
    monkeypatch.setattr(Q, "DEQUANT_CHUNK_ROWS", 16)  # exercise several chunks
    if lead == (40,):
        _chunked_past(monkeypatch, 40)
    qw = Q.quantize_int8(_gaussian(48, 80).to(dtype))
    x, bias = _gaussian(*lead, 80, seed=1).to(dtype), _gaussian(48, seed=2).to(dtype)
    out = Q.linear_int8(x, qw, bias, backend="cpu")
    assert_close_tol(out, Q.linear_int8_ref(x, qw, bias), dtype, DEQUANT_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead", ((1,), (2, 3), (40,)))
@pytest.mark.parametrize("n,group,sym", ((48, 64, False), (32, 32, True), (37, 32, False)))
def test_linear_int4_cpu_matches_ref(monkeypatch, dtype, lead, n, group, sym):
    monkeypatch.setattr(Q, "DEQUANT_CHUNK_ROWS", 16)
    if lead == (40,):
        _chunked_past(monkeypatch, 40)
    qw = Q.quantize_int4(_gaussian(n, 128).to(dtype), group, sym)
    # torch's layout: not kept for tiles (native kernels), and torch's kernel needs out % 16 == 0
    assert (qw.cpu_packed is not None) == (not qw.tiled and n % 16 == 0)
    x, bias = _gaussian(*lead, 128, seed=1).to(dtype), _gaussian(n, seed=2).to(dtype)
    out = Q.linear_int4(x, qw, bias, backend="cpu")
    assert_close_tol(out, Q.linear_int4_ref(x, qw, bias), dtype, DEQUANT_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
def test_portable_int4_is_row_major_codes_only(dtype):
    """portable=True (the offload store's format): pack_int4's row-major codes and nothing else
    (no tiles, no copy in torch's private layout), the same bytes whether or not the native
    kernels run; the CPU path and the row dequantization read them as they are."""
    w = _gaussian(64, 128).to(dtype)
    qw, default = Q.quantize_int4(w, 32, portable=True), Q.quantize_int4(w, 32)
    assert not qw.tiled and qw.cpu_packed is None and qw.cpu_scales_zeros is None
    assert qw.packed.shape == (64, 64) and torch.equal(qw.packed, Q.int4_codes(default))
    assert torch.equal(qw.scales, default.scales) and torch.equal(qw.mins, default.mins)
    rows = Q.dequantize_int4_rows(qw, dtype, 16, 48)
    assert torch.equal(rows, Q.dequantize_int4(qw, dtype)[16:48])
    x = _gaussian(3, 128, seed=1).to(dtype)
    out = Q.linear_int4(x, qw, backend="cpu")
    assert_close_tol(out, Q.linear_int4_ref(x, qw), dtype, DEQUANT_TOL)


@pytest.mark.parametrize("backend", ["ref", "cpu", "triton"])
def test_int8_equalized_matches_its_dequantized_weight(backend):
    """equalize=True: the kernels compute with x * in_scale against plain int8 rows; the result
    is x @ dequantize_int8(qw).T, and equalizing lowers the weight error when columns differ."""
    torch.manual_seed(0)
    w = _gaussian(48, 64) * torch.linspace(0.1, 4.0, 64)  # columns of very different scale
    plain, qw = Q.quantize_int8(w), Q.quantize_int8(w, equalize=True)
    assert qw.in_scale is not None and qw.in_scale.shape == (64,)
    err = [(Q.dequantize_int8(q, torch.float32) - w).pow(2).mean() for q in (plain, qw)]
    assert err[1] < 0.7 * err[0]
    x = torch.randn(3, 64)
    expected = x @ Q.dequantize_int8(qw, torch.float32).t()
    out = Q.linear_int8(x, qw, backend=backend)
    assert torch.allclose(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [40, 24, 8])
def test_int8_cpu_input_size_not_multiple_of_16(k):
    """torch's _weight_int8pack_mm crashes the process for in % 16 != 0: the CPU path must not
    call it there (it takes the chunked dequantize path instead)."""
    qw = Q.quantize_int8(_gaussian(32, k).to(torch.bfloat16))
    x = torch.randn(2, k, dtype=torch.bfloat16)
    out = Q.linear_int8(x, qw, backend="cpu")
    assert torch.allclose(out.float(), Q.linear_int8_ref(x, qw).float(), rtol=2e-2, atol=2e-2)


@requires_triton()
@pytest.mark.parametrize("bits", (8, 4))
def test_many_rows_leave_triton_for_the_reference_unless_named(triton_interpret, monkeypatch,
                                                               bits):
    """The rule for CUDA calls (backend "auto" resolving to Triton): past
    TRITON_QUANT_MAX_ROWS rows, dequantize + the reference's GEMM (cuBLAS there); a backend
    that names Triton keeps it at any row count. Imitated here by resolving "auto" to
    Triton, whose interpreter runs on these CPU tensors."""
    from hf_dsinfer.kernels import _dispatch

    real = _dispatch.resolve
    monkeypatch.setattr(_dispatch, "resolve", lambda backend, device, has_cpu_path=True:
                        "triton" if backend == "auto" else real(backend, device, has_cpu_path))
    w = _gaussian(48, 64).to(torch.bfloat16)
    qw = Q.quantize_int8(w) if bits == 8 else Q.quantize_int4(w, 32, False)
    fast, triton_fn, ref = ((Q.linear_int8, "linear_int8_triton", "linear_int8_ref") if bits == 8
                            else (Q.linear_int4, "linear_int4_triton", "linear_int4_ref"))
    calls = {triton_fn: 0, ref: 0}
    for name in calls:
        original = getattr(Q, name)
        monkeypatch.setattr(Q, name, lambda *a, _f=original, _n=name: calls.__setitem__(
            _n, calls[_n] + 1) or _f(*a))
    many = Q.TRITON_QUANT_MAX_ROWS + 1
    fast(_gaussian(many, 64, seed=1).to(torch.bfloat16), qw, backend="auto")
    assert calls == {triton_fn: 0, ref: 1}
    fast(_gaussian(Q.TRITON_QUANT_MAX_ROWS, 64, seed=1).to(torch.bfloat16), qw, backend="auto")
    fast(_gaussian(many, 64, seed=1).to(torch.bfloat16), qw, backend="triton")
    assert calls == {triton_fn: 2, ref: 1}


def test_a8_reference_reads_x_each_call_and_triton_kernels_are_built_once():
    """The W4A8 reference quantizes the x it is given, every call (a tensor changed in place
    gives new codes: no cache keyed by the tensor object), and the Triton kernels are defined
    once per process (quant._kernels is cached)."""
    x = torch.randn(2, 64)
    first = Q.quantize_activations_int8(x, 32)[0].clone()
    x.mul_(-1)
    assert torch.equal(Q.quantize_activations_int8(x, 32)[0], -first)
    assert hasattr(Q._kernels, "cache_info")


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("tier,fp32", (("avx2", True), ("avx512_bf16", False)))
def test_dequantized_rows_meet_many_bf16_rows_in_fp32_without_bf16_dots(monkeypatch, bits, tier,
                                                                         fp32):
    """The chunked dequantize + GEMM path of 40 bf16 rows (every kernel's bound pinned below)
    runs fp32 GEMMs on the dequantized bf16 rows at a tier without bf16 dot products
    (kernels/linear.py: bf16_gemm_in_fp32), F.linear in bf16 at one with them: the same
    numbers either way, up to the order of the fp32 sums."""
    from hf_dsinfer.kernels import linear as lin

    monkeypatch.setattr(lin._native, "tier", lambda: tier)
    monkeypatch.setattr(lin, "_X86", True)
    monkeypatch.setattr(lin, "fp32_gemm_calls", 0)
    monkeypatch.setattr(lin, "FP32_CHUNK_ROWS", 16)  # several chunks of the 37 rows
    _chunked_past(monkeypatch, 40)
    w = _gaussian(37, 128).to(torch.bfloat16)
    qw = Q.quantize_int8(w) if bits == 8 else Q.quantize_int4(w, 32, False)
    ref_fn = Q.linear_int8_ref if bits == 8 else Q.linear_int4_ref
    fn = Q.linear_int8 if bits == 8 else Q.linear_int4
    x, bias = _gaussian(40, 128, seed=1).bfloat16(), _gaussian(37, seed=2).bfloat16()
    out = fn(x, qw, bias, backend="cpu")
    assert lin.fp32_gemm_calls == int(fp32)
    assert_close_tol(out, ref_fn(x, qw, bias), torch.bfloat16, DEQUANT_TOL)
