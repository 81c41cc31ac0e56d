"""The avx2 tiers' own int8 / int4 dot-product loops (csrc/hfd_avx2.h: AVX2, and avx2_vnni's
AVX-VNNI dot products where the CPU has them) give the bits of every
other tier (the AVX-512 code, native or emulated), on the shapes that reach each of their
branches: int8 tails past the last 64 columns, tiles and row-major rows, several rows of x,
input equalization, x spanning many decades, the int32 bound at a Llama MLP's K; int4 groups of
32 to 256, whole 512-column tile runs followed by 128-column chunks, partial last chunks, fewer
rows than a block, scales of each dtype, and the decode layer with int4 groups of 128.

The comparison tier is the CPU's best, or generic on a CPU whose best tier is an avx2 one.
"""

from __future__ import annotations

import pytest
import torch

from hf_dsinfer.kernels import _native
from hf_dsinfer.kernels import quant as Q
from tests.kernels.test_native_tiers import BEST, _at, _decode_logits

HAS_AVX2 = _native.TIERS.index(_native.cpu_tier()) >= _native.TIERS.index("avx2")
pytestmark = pytest.mark.skipif(not (_native.builds() and HAS_AVX2),
                                reason="needs the native kernels on a CPU with AVX2")
AVX2_TIERS = [t for t in ("avx2", "avx2_vnni") if t in _native.runnable_tiers()]
OTHER = BEST if BEST not in AVX2_TIERS else "generic"


@pytest.fixture(params=AVX2_TIERS)
def tier(request) -> str:
    """Each avx2 tier this CPU has."""
    return request.param


def _native_runs(monkeypatch, name: str) -> list[bool]:
    """Wrap quant.<name> (a native kernel's caller, None where it did not run): one entry per
    call, whether the native kernel ran."""
    ran, original = [], getattr(Q, name)

    def counted(*args):
        out = original(*args)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(Q, name, counted)
    return ran


def _same_as_other(monkeypatch, tier, fn, kernel: str) -> None:
    """fn() at `tier` equals fn() at OTHER, to the bit, and both ran the native kernel called
    by quant.<kernel>."""
    ran = _native_runs(monkeypatch, kernel)
    want, got = _at(monkeypatch, OTHER, fn), _at(monkeypatch, tier, fn)
    assert ran and all(ran), f"the native kernel did not run: {ran}"
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want), (f"{tier} differs from {OTHER}: max |diff| "
                                    f"{(got.float() - want.float()).abs().max().item()}")


def _wide(*shape, seed, dtype=torch.bfloat16):
    """Values spanning 6 decades (the fixed point of x keeps 24 bits of the absmax)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.pow(10.0, torch.rand(*shape, generator=g) * 6 - 3)
    return (torch.randn(*shape, generator=g) * mag).to(dtype)


def test_the_avx2_libraries_run_their_own_loops(monkeypatch, tier):
    """1: the AVX2 loops; 2: with AVX-VNNI's vpdpbusd / vpdpwssd (the avx2_vnni tier)."""
    want = {"avx2": 1, "avx2_vnni": 2}[tier]
    assert _at(monkeypatch, tier, lambda: _native.lib().hfd_avx2_dots()) == want
    assert _at(monkeypatch, OTHER, lambda: _native.lib().hfd_avx2_dots()) == 0


def _rows_layout(qw: Q.Int8Weight) -> Q.Int8Weight:
    return qw._replace(qweight=Q.untile_rows(qw.qweight), tiled=False) if qw.tiled else qw


# (rows of x, out, in, x dtype, equalize, layout): tails of 8 and 40 columns (row-major only:
# tiles are whole 64-column chunks), 1 to 16 rows, an out that is not a whole block
INT8 = [(1, 64, 200, torch.bfloat16, False, "rows"), (5, 128, 320, torch.float32, True, "rows"),
        (5, 128, 320, torch.float32, True, "tiles"), (16, 96, 1000, torch.float16, False, "rows"),
        (3, 64, 2048, torch.bfloat16, False, "tiles"), (2, 38, 64, torch.bfloat16, True, "rows")]


@pytest.mark.parametrize("rows,n,k,dtype,equalize,layout", INT8)
def test_int8_gemv(monkeypatch, tier, rows, n, k, dtype, equalize, layout):
    w = _wide(n, k, seed=1, dtype=dtype)
    qw = _at(monkeypatch, BEST, lambda: Q.quantize_int8(w, equalize=equalize))
    assert qw.tiled == (n % 4 == 0 and k % 64 == 0)  # tiles where the shape allows
    if layout == "rows":
        qw = _rows_layout(qw)
    assert qw.tiled == (layout == "tiles")
    x = _wide(rows, k, seed=2, dtype=dtype)
    with torch.inference_mode():
        _same_as_other(monkeypatch, tier, lambda: Q.linear_int8(x, qw, backend="cpu"),
                       "_native_int8")


def test_int8_gemv_at_the_int32_bound(monkeypatch, tier):
    """Every x at its absmax and every weight at +-127 over a Llama MLP's K = 5632: each lane's
    int32 sums at their largest; the result is the exact dot product."""
    k = 5632
    w = torch.ones(8, k)
    w[1::2] = -1
    qw = Q.quantize_int8(w)
    x = torch.full((1, k), 3.0)
    _same_as_other(monkeypatch, tier, lambda: Q.linear_int8(x, qw, backend="cpu"), "_native_int8")
    y = _at(monkeypatch, tier, lambda: Q.linear_int8(x, qw, backend="cpu"))
    torch.testing.assert_close(y, (x.double() @ w.double().T).float(), rtol=1e-6, atol=0)


# (rows of x, out, in, group): one 512-column run; runs then chunks (640 = 512 + 128, 1536);
# a partial last chunk (row-major only); out not a whole block
INT4 = [(1, 64, 512, 32), (3, 32, 640, 64), (1, 16, 1536, 128), (2, 8, 768, 256),
        (1, 12, 160, 32), (2, 7, 384, 128)]


@pytest.mark.parametrize("wdtype", (torch.bfloat16, torch.float16, torch.float32),
                         ids=("bf16 scales", "fp16 scales", "fp32 scales"))
@pytest.mark.parametrize("rows,n,k,group", INT4)
def test_int4_linear(monkeypatch, tier, rows, n, k, group, wdtype):
    w = _wide(n, k, seed=3, dtype=wdtype)
    stored = _at(monkeypatch, BEST, lambda: Q.quantize_int4(w, group))
    assert stored.tiled == (n % 4 == 0 and k // 2 % 64 == 0)  # tiles where the shape allows
    portable = Q.quantize_int4(w, group, portable=True)  # row-major codes: any tier runs them
    x = _wide(rows, k, seed=4)
    for qw in (stored, portable):
        with torch.inference_mode():
            _same_as_other(monkeypatch, tier, lambda qw=qw: Q.linear_int4(x, qw, backend="cpu"),
                           "_native_int4")


def test_decode_layer_int4_group_128(monkeypatch, tier):
    """_decode_logits asserts that the native decode layer ran."""
    want = _at(monkeypatch, OTHER, lambda: _decode_logits({"bits": 4, "group_size": 128}))
    got = _at(monkeypatch, tier, lambda: _decode_logits({"bits": 4, "group_size": 128}))
    assert torch.equal(got, want)
