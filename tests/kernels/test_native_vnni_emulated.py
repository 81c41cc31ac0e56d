"""The avx2_vnni tier's own loops on a CPU without AVX-VNNI.

The avx2_vnni tier (Intel's client CPUs from Alder Lake, Zen 5) replaces the avx2 tier's
vpmaddubsw + vpmaddwd pairs by AVX-VNNI's vpdpbusd / vpdpwssd on ymm (csrc/hfd_avx2.h, and the
W4A8 loops of csrc/cpu_decode.c and cpu_qgemm.c) and promises the same int32 lane sums, so the
same bits as the avx2 tier. Where the CPU lacks AVX-VNNI (every AVX-512 Xeon and EPYC before
Zen 5, and the AVX2 EPYCs) those loops never ran here. This module builds the avx2 tier with
HFD_EMULATE_AVX_VNNI (csrc/hfd_simd.h): the avx2_vnni tier's loops with exact AVX2 emulations of
the two instructions, which runs on any AVX2 CPU, and compares it with the avx2 tier, to the
bit: the int8 GEMV, the int4 linear (tiles and rows), W4A8 at one row (hfd_int4_a8_rows) and
at many (hfd_int4_gemm_a8), and the native decode layer with int8, int4 and W4A8 weights.

It checks the loops (their indexing, the order of their sums); the instructions' own
semantics are the emulation's, written from Intel's definition. On a CPU with AVX-VNNI the
real instructions run in test_native_tiers.py and test_native_avx2.py.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from switches import switch

from hf_dsinfer.kernels import _native, abi
from hf_dsinfer.kernels import quant as Q
from tests.kernels.test_native_tiers import _decode_logits, _gaussian

pytestmark = pytest.mark.skipif(
    not _native.builds() or "avx2" not in _native.runnable_tiers(),
    reason=f"needs the native kernels at the avx2 tier (tiers here: "
           f"{_native.runnable_tiers()}; {_native.why_unavailable()})")


@pytest.fixture(scope="module")
def emulated():
    """The avx2 tier built with the avx2_vnni tier's loops (hfd_avx2_dots() says which)."""
    path = _native.build("avx2", defines=("HFD_EMULATE_AVX_VNNI",))
    lib = ctypes.CDLL(str(path))
    abi.check(lib, str(path))
    _native._declare(lib)
    assert lib.hfd_avx2_dots() == 2, "the build did not take the avx2_vnni loops"
    return lib


def _at(monkeypatch, lib, fn):
    """fn() with the kernels at the avx2 tier: its own library (lib None) or `lib`."""
    with monkeypatch.context() as m:
        switch(m, isa="avx2")
        switch(m, amx=False)
        if lib is not None:
            m.setattr(_native, "_load", lambda level: lib)
        assert _native.tier() == "avx2"
        assert _native.lib().hfd_avx2_dots() == (1 if lib is None else 2)
        return fn()


def _same(monkeypatch, emulated, fn):
    want, got = _at(monkeypatch, None, fn), _at(monkeypatch, emulated, fn)
    for w, g in zip(want if isinstance(want, tuple) else (want,),
                    got if isinstance(got, tuple) else (got,)):
        assert torch.equal(g, w), (f"the avx2_vnni loops differ from avx2's: max |diff| "
                                   f"{(g.float() - w.float()).abs().max().item()}")


@pytest.mark.parametrize("rows,n,k", [(1, 256, 320), (3, 64, 1024)])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_int8_linear(monkeypatch, emulated, rows, n, k, dtype):
    qw = Q.quantize_int8(_gaussian(n, k, seed=1, dtype=dtype))
    x = _gaussian(rows, k, seed=2, dtype=dtype)
    _same(monkeypatch, emulated, lambda: Q.linear_int8(x, qw, backend="cpu"))


@pytest.mark.parametrize("rows,n,k,group,portable", [
    (1, 64, 1024, 32, False),   # whole 512-column runs of tiles
    (4, 128, 640, 64, False),   # a run and a 128-column rest
    (2, 64, 576, 32, True),     # row-major codes (SmolLM2's hidden size)
    (1, 64, 160, 32, True),     # a partial last chunk
])
def test_int4_linear(monkeypatch, emulated, rows, n, k, group, portable):
    qw = Q.quantize_int4(_gaussian(n, k, seed=3), group, portable=portable)
    x = _gaussian(rows, k, seed=4)
    _same(monkeypatch, emulated, lambda: Q.linear_int4(x, qw, backend="cpu"))


@pytest.mark.parametrize("rows", (1, 5, 20))  # the batch-1 kernel to a8_rows_max_rows, then the panel
@pytest.mark.parametrize("portable", (False, True), ids=("tiles", "row_major"))
def test_w4a8_linear(monkeypatch, emulated, rows, portable):
    qw = Q.quantize_int4(_gaussian(48, 1152, seed=5), 32, portable=portable)._replace(act_bits=8)
    x = _gaussian(rows, 1152, seed=6)
    _same(monkeypatch, emulated, lambda: Q.linear_int4_a8_cpu(x, qw))


@pytest.mark.parametrize("quant", [{"bits": 8}, {"bits": 4, "group_size": 32},
                                   {"bits": 4, "group_size": 32, "act_bits": 8}],
                         ids=("int8", "int4", "w4a8"))
def test_native_decode_layer(monkeypatch, emulated, quant):
    _same(monkeypatch, emulated, lambda: _decode_logits(quant))
