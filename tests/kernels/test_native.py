"""The native CPU int8 kernel (csrc/cpu_quant.c via kernels/_native.py).

It must compute what the dequantize-then-F.linear reference computes, to fp32 accuracy (its 24-bit
fixed-point x is exact for the values a bf16 / fp16 x can hold), and the CPU entry point must
really call it where it applies (counted), and not where it does not.
"""

from __future__ import annotations

import pytest
import torch
from switches import switch

from hf_dsinfer.kernels import _native, crossovers
from hf_dsinfer.kernels import kv_quant as KV
from hf_dsinfer.kernels import linear as lin
from hf_dsinfer.kernels import quant as Q
from tests.kernels.conftest import REDUCTION_TOL, assert_close_tol, count_calls, pin_crossovers

pytestmark = [pytest.mark.skipif(not _native.builds(),
               reason=f"native CPU kernels unavailable: {_native.why_unavailable()}"),
              pytest.mark.usefixtures("native_tier")]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _gaussian(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def _count(monkeypatch, name):
    return count_calls(monkeypatch, Q, name)


def _exact(x, w, bias=None):
    """x @ w.T + bias in float64: the value every kernel approximates."""
    y = x.double() @ w.double().t()
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", (128, 80, 40, 8))  # 80, 40, 8: a masked tail of the 64-wide loop
@pytest.mark.parametrize("rows", (1, 3, 8))
@pytest.mark.parametrize("equalize", (False, True))
@pytest.mark.parametrize("n", (37, 40))  # 40 x 128: stored as int8 tiles
def test_int8_native_matches_exact(monkeypatch, dtype, k, rows, equalize, n):
    pin_crossovers(monkeypatch, int8_gemv_max_rows=8)  # the kernel's numerics, at every tier
    calls = _count(monkeypatch, "_native_int8")
    w = _gaussian(n, k) * torch.linspace(0.2, 3.0, k)
    qw = Q.quantize_int8(w.to(dtype), equalize=equalize)
    assert qw.tiled == (n % 4 == 0 and k % 64 == 0)
    x, bias = _gaussian(rows, k, seed=1).to(dtype), _gaussian(n, seed=2).to(dtype)
    out = Q.linear_int8(x, qw, bias, backend="cpu")
    assert calls == [1] and out.dtype == dtype and out.shape == (rows, n)
    expected = _exact(x, Q.dequantize_int8(qw, torch.float32), bias)
    # the only roundings left are fp32 ones and the final one to `dtype`
    ulp = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    assert torch.allclose(out.double(), expected, rtol=ulp, atol=ulp * expected.abs().max())


def test_int8_native_extreme_inputs():
    """A zero row, one huge element among small ones, and 3-D x."""
    qw = Q.quantize_int8(_gaussian(16, 64))
    x = torch.zeros(2, 3, 64)
    x[1, 2, 5] = 1e4
    x[1, 2, 6:] = 1e-3
    out = Q.linear_int8(x, qw, backend="cpu")
    expected = _exact(x.reshape(-1, 64), Q.dequantize_int8(qw, torch.float32)).reshape(2, 3, 16)
    assert torch.equal(out[0], torch.zeros(3, 16))
    assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-3)


def test_native_not_used_above_its_rows(monkeypatch):
    """More rows than the tier's int8_gemv_max_rows: torch's kernels, same results."""
    c8 = _count(monkeypatch, "_native_int8")
    rows = crossovers.rows().int8_gemv_max_rows + 1
    q8 = Q.quantize_int8(_gaussian(32, 64).bfloat16())
    x = _gaussian(rows, 64, seed=1).bfloat16()
    out, ref = Q.linear_int8(x, q8, backend="cpu").float(), Q.linear_int8_ref(x, q8).float()
    assert c8 == [] and torch.allclose(out, ref, rtol=2e-2, atol=2e-2 * ref.abs().max())


def test_int8_tiles_hold_the_row_major_codes(monkeypatch):
    """quantize_int8 stores whole-tile shapes as tiles, with the codes it stores row-major when
    the library is off; a tiled weight still computes where the library is switched off after
    quantization (torch's dequantization of the untiled rows)."""
    w, x = _gaussian(40, 192), _gaussian(3, 192, seed=1)
    tiled = Q.quantize_int8(w, equalize=True)
    y = Q.linear_int8(x, tiled, backend="cpu")
    switch(monkeypatch, native=False)
    row_major = Q.quantize_int8(w, equalize=True)
    assert tiled.tiled and not row_major.tiled and tiled.qweight.shape == (10, 3, 4, 64)
    assert torch.equal(Q.int8_matrix(tiled), row_major.qweight)
    assert torch.equal(tiled.rowsum, row_major.rowsum)
    off = Q.linear_int8(x, tiled, backend="cpu")  # no native kernel now
    assert torch.allclose(off, y, rtol=1e-4, atol=1e-4 * y.abs().max())


def test_int4_tiles_hold_the_row_major_codes(monkeypatch):
    """quantize_int4 stores whole-tile shapes as tiles, with the codes it packs row-major when
    the library is off (two 512-column runs in the tiles' column order, then 128 columns in
    row order); a tiled weight still computes with the library switched off, and the C
    dequantization (40 rows of x: the chunked path) reads the tiles' order as Python wrote it."""
    w, x = _gaussian(40, 1152), _gaussian(40, 1152, seed=1)
    tiled = Q.quantize_int4(w, 32)
    # 40 rows past the native kernel's bound, whatever the tier measured: the chunked path
    pin_crossovers(monkeypatch, int4_native_max_rows=8)
    y = Q.linear_int4(x, tiled, backend="cpu")
    switch(monkeypatch, native=False)
    row_major = Q.quantize_int4(w, 32)
    assert tiled.tiled and not row_major.tiled and tiled.packed.shape == (10, 9, 4, 64)
    assert not torch.equal(Q.untile_rows(tiled.packed), row_major.packed)  # reordered runs
    assert torch.equal(Q.int4_codes(tiled), row_major.packed)
    assert torch.equal(Q.linear_int4(x, tiled, backend="cpu"), y)
    assert torch.equal(Q.linear_int4_ref(x, tiled), Q.linear_int4_ref(x, row_major))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,group", [(64, 1152, 32), (48, 384, 128), (40, 1024, 256),
                                       (22, 320, 64)])
@pytest.mark.parametrize("rows", (1, 2, 7, 32))
def test_native_int4_rows_against_float64(monkeypatch, dtype, n, k, group, rows):
    """1-32 rows of x times a 4-bit weight by the native kernel (hfd_int4_linear): tiles with
    whole 512-column runs and a rest (1152, 1024), tiles without a run (384), row-major rows
    (22 rows, not whole tiles) with a partial last chunk (320). Against the dequantized weight
    in float64: within half an ulp of the output dtype plus 1e-4 of the largest output (x as
    24-bit fixed point per group, integer sums). A tiled weight keeps no second copy of its
    codes in torch's layout."""
    pin_crossovers(monkeypatch, int4_native_max_rows=32)  # the kernel's numerics, every tier
    w = (_gaussian(n, k) * 0.05).to(dtype)
    x, bias = _gaussian(rows, k, seed=1).to(dtype), _gaussian(n, seed=2).to(dtype)
    x[:, ::7] *= 100.0  # groups spanning 4 decades
    qw = Q.quantize_int4(w, group)
    assert qw.tiled == (n % 4 == 0 and k % 128 == 0) and (qw.cpu_packed is None or not qw.tiled)
    calls = _count(monkeypatch, "_native_int4")
    out = Q.linear_int4(x, qw, bias, backend="cpu")
    assert len(calls) == 1 and out.dtype == dtype
    ref = _exact(x, Q.dequantize_int4(qw, torch.float32)) + bias.double()
    ulp = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    # the product is rounded to dtype, then the bias added in dtype (as nn.Linear rounds)
    bound = (ref.abs() + bias.double().abs()) * 2 * ulp + 1e-4 * ref.abs().max()
    assert ((out.double() - ref).abs() <= bound).all(), (out.double() - ref).abs().max()


def test_native_int4_rows_do_not_depend_on_the_batch(monkeypatch):
    """32 rows and 1 row give the same per-row result: a row of x is computed the same way
    whatever the batch around it (the batch-1 numerics, row by row)."""
    pin_crossovers(monkeypatch, int4_native_max_rows=32)
    w, x = _gaussian(64, 1152) * 0.05, _gaussian(32, 1152, seed=1).bfloat16()
    qw = Q.quantize_int4(w.bfloat16(), 32)
    many = Q.linear_int4(x, qw, backend="cpu")
    one = torch.cat([Q.linear_int4(x[i:i + 1], qw, backend="cpu") for i in range(32)])
    assert torch.equal(many, one)


AMX_INT8 = pytest.mark.skipif(not _native.amx_int8_available(),
                              reason="no AMX-INT8 here: int8 linears keep the GEMV")


@pytest.mark.amx
@AMX_INT8
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("equalize", (False, True))
@pytest.mark.parametrize("rows", (4, 5, 16, 17, 40))
def test_int8_amx_is_the_gemv_to_the_bit(monkeypatch, dtype, equalize, rows):
    """4+ rows of x on AMX-INT8 tiles (hfd_int8_amx): the same integer sums and float
    operations as the native GEMV, so the same bits, with and without bias and input
    equalization, for a partial last 16-row tile of x; and it is what linear_int8 runs
    (counted), unless HF_DSINFER_NATIVE_AMX=0."""
    w = (_gaussian(96, 320) * 0.05).to(dtype)
    x, bias = _gaussian(rows, 320, seed=1).to(dtype), _gaussian(96, seed=2).to(dtype)
    qw = Q.quantize_int8(w, equalize=equalize)
    assert qw.tiled
    for b in (None, bias):
        gemv = Q._native_int8(_native.lib(), x, qw, b)
        amx = Q._native_int8_amx(x, qw, b)
        assert amx is not None and torch.equal(amx, gemv)
    calls = _count(monkeypatch, "_native_int8_amx")
    out = Q.linear_int8(x.reshape(1, rows, 320), qw, bias, backend="cpu")
    gemv = Q._native_int8(_native.lib(), x, qw, bias)
    assert len(calls) == 1 and torch.equal(out.reshape(rows, 96), gemv)
    switch(monkeypatch, amx=False)
    assert Q._native_int8_amx(x, qw, bias) is None


@pytest.mark.amx
@AMX_INT8
def test_int8_amx_takes_only_what_it_computes():
    """Fewer than AMX_INT8_MIN_ROWS or more than AMX_INT8_MAX_ROWS rows, row-major codes, or an
    output size not a multiple of 16: None (the GEMV or torch's kernels run)."""
    w = _gaussian(96, 320) * 0.05
    x = _gaussian(Q.AMX_INT8_MIN_ROWS - 1, 320, seed=1)
    assert Q._native_int8_amx(x, Q.quantize_int8(w), None) is None  # too few rows
    x = _gaussian(Q.AMX_INT8_MAX_ROWS + 1, 320, seed=1)
    assert Q._native_int8_amx(x, Q.quantize_int8(w), None) is None  # a prefill: oneDNN
    x = _gaussian(8, 320, seed=1)
    assert Q._native_int8_amx(x, Q.quantize_int8(w[:, :300]), None) is None  # row-major
    assert Q._native_int8_amx(x, Q.quantize_int8(w[:88]), None) is None  # 88 % 16
    assert Q._native_int8_amx(x, Q.quantize_int8(w), None) is not None


def test_native_can_be_switched_off(monkeypatch):
    switch(monkeypatch, native=False)
    assert not _native.available() and "disabled" in _native.why_unavailable()
    calls = _count(monkeypatch, "_native_int8")
    qw = Q.quantize_int8(_gaussian(32, 64))
    Q.linear_int8(_gaussian(1, 64), qw, backend="cpu")
    assert calls == []


def test_failed_build_falls_back_with_reason(monkeypatch, tmp_path):
    """No working compiler: lib() is None, the reason names the failure, nothing is cached."""
    switch(monkeypatch, cache_dir=tmp_path)
    monkeypatch.setenv("CC", "/bin/false")
    _native._load.cache_clear()
    monkeypatch.setattr(_native, "_why", {})
    try:
        assert _native.lib() is None
        assert "build failed" in _native.why_unavailable()
        assert not list(tmp_path.rglob("*.so"))
    finally:
        _native._load.cache_clear()


def test_explain_names_the_int8_kernel(monkeypatch):
    from tiny_models import make_model

    import hf_dsinfer

    model = hf_dsinfer.init_inference(make_model("llama"), quant={"bits": 8})
    assert "int8 CPU kernel: native" in hf_dsinfer.explain(model)
    switch(monkeypatch, native=False)
    assert "_weight_int8pack_mm (native kernel unavailable: disabled" in hf_dsinfer.explain(model)


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_dequantize_is_torchs_to_the_bit(monkeypatch, dtype):
    """Rows of int4 (groups 32 / 128) and int8 (with and without equalization) weights, as the
    GEMM of many rows (prefill) dequantizes them: the native rows equal the torch ops' rows, and
    a prefill-sized linear runs on them (counted)."""
    w = (_gaussian(320, 256) * 0.05).to(dtype)
    for group in (32, 128):
        # 320 x 256 is stored as 4-bit tiles, 318 x 256 (not whole 4-row tiles) row-major
        for qw, tiled in ((Q.quantize_int4(w, group), True), (Q.quantize_int4(w[:318], group), False)):
            assert qw.tiled == tiled
            ref = Q._dequantize_int4_rows(Q.int4_codes(qw)[64:318], qw.scales[64:318],
                                          qw.mins[64:318], group, dtype)
            assert torch.equal(Q.dequantize_int4_rows(qw, dtype, 64, 318), ref)
    # 768 columns: 384 bytes a row, one whole 256-byte super-chunk (cpu_quant.c's direct
    # offsets) and a tail in plain order
    w3 = (_gaussian(64, 768) * 0.05).to(dtype)
    for group in (32, 128):
        qw = Q.quantize_int4(w3, group)
        assert qw.tiled
        ref = Q._dequantize_int4_rows(Q.int4_codes(qw)[4:60], qw.scales[4:60], qw.mins[4:60],
                                      group, dtype)
        assert torch.equal(Q.dequantize_int4_rows(qw, dtype, 4, 60), ref)
    for equalize in (False, True):
        # 320 x 256 is stored as int8 tiles, 320 x 240 (not whole 64-column tiles) row-major
        for q8, tiled in ((Q.quantize_int8(w, equalize=equalize), True),
                          (Q.quantize_int8(w[:, :240], equalize=equalize), False)):
            assert q8.tiled == tiled
            rows = Q.Int8Weight(Q.int8_matrix(q8)[64:320], q8.scales[64:320], q8.in_scale)
            assert torch.equal(Q._int8_rows(q8, dtype, 64, 320), Q.dequantize_int8(rows, dtype))
    lib = _native.lib()
    calls = []
    monkeypatch.setattr(Q, "_native_dequant_lib", lambda *a: calls.append(1) or lib)
    bounds = crossovers.rows()  # more rows than any direct kernel takes: the chunked path
    x = _gaussian(max(bounds.int4_native_max_rows, bounds.int4_pack_max_rows,
                      bounds.int4_gemm_max_rows or 0, bounds.amx_int4_max_rows or 0) + 1, 256,
                  seed=1).to(dtype)
    out = Q.linear_int4(x, Q.quantize_int4(w, 32), backend="cpu")
    ref = Q.linear_int4_ref(x, Q.quantize_int4(w, 32))
    if lin.bf16_gemm_in_fp32(x, x.shape[0]):  # no bf16 dot products: fp32 GEMMs on those rows
        assert calls
        assert_close_tol(out, ref, dtype, REDUCTION_TOL)  # F.linear's up to the sums' order
    else:
        assert calls and torch.equal(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_kv_int4_decoding_is_torchs_to_the_bit(monkeypatch, dtype):
    """A token-major 4-bit KV cache decoded into attention's [rows, heads, tokens, D] layout:
    from contiguous RAM tensors and from a file's interleaved records (strided tokens), into a
    fresh tensor and into a slice of a larger one. Equal to the torch decoding, permuted; the
    native kernel ran (counted); a group it does not take (8) falls back to torch."""
    lib = _native.lib()
    native = []
    monkeypatch.setattr(KV, "_native_kv_lib",
                        lambda *a, _f=KV._native_kv_lib: native.append(_f(*a)) or native[-1])
    tokens, rows, heads = 23, 3, 4
    for head_dim, group in ((80, 80), (80, 16), (128, 64), (64, 8)):
        x = _gaussian(tokens * rows * heads, head_dim).view(tokens, rows, heads, head_dim)
        codes = KV.quantize_kv_int4(x.to(dtype), group)
        ref = KV.dequantize_kv_int4(codes, dtype).permute(1, 2, 0, 3)
        assert torch.equal(KV.dequantize_kv_int4_tokens(codes, dtype), ref)
        # the same codes as records [packed | scales | mins | padding] of one byte tensor
        parts = [codes.packed.reshape(tokens, -1), codes.scales.view(torch.uint8).reshape(tokens, -1),
                 codes.mins.view(torch.uint8).reshape(tokens, -1)]
        raw = torch.cat(parts + [torch.zeros(tokens, 6, dtype=torch.uint8)], dim=1)
        widths = [p.shape[1] for p in parts]
        cols = torch.split(raw, widths + [6], dim=1)
        strided = KV.KVInt4(cols[0].view(tokens, rows, heads, -1),
                            cols[1].view(torch.float16).view(tokens, rows, heads, -1),
                            cols[2].view(torch.float16).view(tokens, rows, heads, -1), group)
        big = torch.zeros(rows, heads, tokens + 5, head_dim, dtype=dtype)
        KV.dequantize_kv_int4_tokens(strided, dtype, big[:, :, 2:2 + tokens])
        assert torch.equal(big[:, :, 2:2 + tokens], ref)
        assert not big[:, :, :2].any() and not big[:, :, 2 + tokens:].any()
        assert all(n is lib for n in native[-2:]) == (group % 16 == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_kv_int4_codes_are_the_references(monkeypatch, dtype):
    """quantize_kv_int4 on the CPU: the native kernel's codes, scales and mins equal the torch
    reference's bit for bit, over five decades of scale and at the edges (a constant group, a
    zero group, NaN, inf), and it ran (counted); a group it does not take (8) uses the reference."""

    lib, native = _native.lib(), []
    monkeypatch.setattr(_native, "lib", lambda use="kernels": native.append(1) or lib)
    for head_dim, group in ((80, 80), (80, 16), (128, 64), (64, 8)):
        for scale in (1e-6, 1e-2, 1.0, 3e4):
            x = (_gaussian(29 * 3 * 4, head_dim).view(29, 3, 4, head_dim) * scale).to(dtype)
            x[0, 0, 0] = 0.3
            x[0, 0, 1, :group] = 0.0
            x[1, 0, 0, 5] = float("nan")
            x[1, 1, 0, 2] = float("inf")
            before = len(native)
            got, ref = KV.quantize_kv_int4(x, group), KV.quantize_kv_int4_ref(x, group)
            assert (len(native) > before) == (group % 16 == 0)
            assert torch.equal(got.packed, ref.packed)
            for a, b in ((got.scales, ref.scales), (got.mins, ref.mins)):
                assert torch.equal(a.view(torch.int16), b.view(torch.int16))  # NaN bits too


def _kv_codes(tokens, rows, kv_heads, head_dim, group, dtype, seed):
    x = _gaussian(tokens * rows * kv_heads, head_dim, seed=seed) * 2 + 0.5  # off-centre mins
    return KV.quantize_kv_int4(x.view(tokens, rows, kv_heads, head_dim).to(dtype), group)


def _as_records(codes_k, codes_v):
    """K and V codes as the records of one cache file ([k.packed | k.scales | k.mins | v... |
    2 padding bytes] per token, views strided by the record), as FileStorage reads them."""
    tokens, group = codes_k.packed.shape[0], codes_k.group_size
    parts = [p.reshape(tokens, -1).view(torch.uint8) if p.dtype != torch.uint8 else
             p.reshape(tokens, -1) for c in (codes_k, codes_v) for p in c[:3]]
    raw = torch.cat(parts + [torch.zeros(tokens, 2, dtype=torch.uint8)], dim=1)
    cols = torch.split(raw, [p.shape[1] for p in parts] + [2], dim=1)
    out = []
    for i, like in enumerate((codes_k, codes_v)):
        packed, scales, mins = cols[3 * i: 3 * i + 3]
        out.append(KV.KVInt4(packed.view(like.packed.shape),
                             scales.view(torch.float16).view(like.scales.shape),
                             mins.view(torch.float16).view(like.mins.shape), group))
    assert out[0].packed.stride(0) == raw.shape[1]  # strided, not copied
    return KV.KVSpan(*out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,heads,kv_heads,head_dim,group", [
    (3, 4, 4, 80, 80),  # OPT-2.7B's head, one group (64 does not divide 80)
    (2, 6, 2, 64, 32),  # grouped-query heads, two groups per head
    (2, 4, 1, 128, 64),  # one kv head, a 16-byte code run and a masked one per group
    (1, 2, 2, 16, 16),  # the tiny test models
])
def test_native_attention_over_kv_codes(dtype, rows, heads, kv_heads, head_dim, group):
    """Decode attention straight over a 4-bit cache (the offload engine's decode step): the
    native kernel against float64 attention over the codes' values, with the cache in two
    spans (a file's strided records, then a RAM token), grouped-query heads, and keep masks
    (keep_rows' form: uint8 per row, one bool row for all rows, a row masked everywhere ->
    zeros while the others match); it ran (counted)."""
    old = _as_records(_kv_codes(37, rows, kv_heads, head_dim, group, dtype, 1),
                      _kv_codes(37, rows, kv_heads, head_dim, group, dtype, 2))
    new = KV.KVSpan(_kv_codes(1, rows, kv_heads, head_dim, group, dtype, 3),
                    _kv_codes(1, rows, kv_heads, head_dim, group, dtype, 4))
    q = _gaussian(rows * heads, head_dim, seed=5).view(rows, heads, head_dim).to(dtype)
    keep = torch.ones(rows, 38, dtype=torch.uint8)
    keep[0, :4] = 0
    keep[-1, 6:9] = 0
    shared = torch.ones(1, 38, dtype=torch.bool)
    shared[0, 10:12] = False
    everywhere = keep.clone()
    everywhere[0] = 0
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    before = KV.ATTEND_CALLS["native"]
    for k in (None, keep, shared, everywhere):
        got = KV.attend_kv_int4(q, [old, new], head_dim ** -0.5, k)
        ref = KV.attend_kv_int4_ref(q.double(), [old, new], head_dim ** -0.5, k)
        torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol)
    assert KV.ATTEND_CALLS["native"] == before + 4
    assert not got[0].any() and got.isfinite().all()  # the row masked everywhere: zeros
    if rows > 1:  # and the rows masking nothing new are the per-row mask's
        keep_only = KV.attend_kv_int4(q, [old, new], head_dim ** -0.5, keep)
        assert torch.equal(got[1:], keep_only[1:])


def test_attention_over_kv_codes_refuses_bad_shapes():
    codes = _kv_codes(5, 2, 2, 64, 32, torch.float32, 1)
    span = KV.KVSpan(codes, codes)
    q = torch.randn(2, 4, 64)
    with pytest.raises(ValueError, match=r"q \[rows, heads, D\]"):
        KV.attend_kv_int4(q[0], [span], 0.1)
    with pytest.raises(ValueError, match="kv heads dividing 3"):
        KV.attend_kv_int4(torch.randn(2, 3, 64), [span], 0.1)
    with pytest.raises(ValueError, match=r"keep must be bool or uint8 \[2 or 1, 5\]"):
        KV.attend_kv_int4(q, [span], 0.1, torch.ones(2, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="keep must be bool or uint8"):
        KV.attend_kv_int4(q, [span], 0.1, torch.zeros(2, 5))  # an additive mask
