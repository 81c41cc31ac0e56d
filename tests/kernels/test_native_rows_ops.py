"""RMSNorm of many bf16 rows by the native decode layer's code (kernels/norms.py: rms_norm_cpu
-> hfd_rms_rows_bf16): HF's eager roundings, so the eager reference's bits but for a rare
last-bit flip where torch's own reduction rounds otherwise (it moves with its CPU capability);
the same bits at every ISA tier; counted; other calls, and tiers below _native.MIN_TIER["rows"]
(where it measured slower), keep torch's ops. The same holds for the native RoPE
(test_native_rope.py)."""

from __future__ import annotations

import pytest
import torch
from switches import switch

from hf_dsinfer.kernels import _native
from hf_dsinfer.kernels import norms as N
from tests.kernels.conftest import count_calls

pytestmark = [pytest.mark.skipif(not _native.builds(),
               reason=f"native CPU kernels unavailable: {_native.why_unavailable()}"),
              pytest.mark.usefixtures("native_tier")]


def _gaussian(*shape, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).bfloat16()


def _nearly_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bits but for at most 0.1% of the values, each one bf16 ulp away."""
    assert got.dtype == want.dtype and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    assert (diff <= want.float().abs() * 2.0**-7 + 1e-30).all(), diff.max()
    assert (got != want).float().mean() <= 1e-3


@pytest.mark.parametrize("rows,n", [(1, 576), (37, 2048), (5, 100), (64, 1152)])
def test_rms_rows_are_hfs(monkeypatch, rows, n):
    x, res = _gaussian(rows, n, seed=1), _gaussian(rows, n, seed=2)
    w = (_gaussian(n, seed=3, scale=0.3).float() + 1).bfloat16()
    calls = count_calls(monkeypatch, N, "_rms_native")
    out, h = N.rms_norm(x, w, 1e-6, residual=res, backend="cpu")
    assert len(calls) == 1
    want, want_h = N.rms_norm_ref(x, w, 1e-6, residual=res)
    assert torch.equal(h, want_h)
    _nearly_equal(out, want)


def test_every_tier_computes_the_same_bits(monkeypatch):
    x, w = _gaussian(9, 320, seed=6), (_gaussian(320, seed=7, scale=0.3).float() + 1).bfloat16()
    outs = []
    for tier in _native.runnable_tiers():
        switch(monkeypatch, isa=tier)
        outs.append(N.rms_norm(x, w, 1e-5, backend="cpu")[0])
    assert all(torch.equal(outs[0], o) for o in outs)


def test_other_calls_keep_torchs_ops(monkeypatch):
    rms = count_calls(monkeypatch, N, "_rms_native")
    x, w = _gaussian(4, 64), _gaussian(64, seed=1)
    for style in ("fp32", "gemma"):  # their fp32 multiply: torch's ops
        assert torch.equal(N.rms_norm(x, w, 1e-6, backend="cpu", style=style)[0],
                           N.rms_norm_cpu(x, w, 1e-6, style=style)[0])
    N.rms_norm(x.float(), w.float(), 1e-6, backend="cpu")  # fp32
    N.rms_norm(x.t(), _gaussian(4, seed=2), 1e-6, backend="cpu")  # not contiguous
    N.rms_norm(x, w, 1e-6, backend="ref")
    assert not rms


def test_below_its_tier_torch_computes(monkeypatch):
    """An AVX2 CPU (pretended, no tier named): RMSNorm and RoPE of many rows keep torch's ops
    (SIMDe's emulated 512-bit vectors made them 8-11x slower there)."""
    from hf_dsinfer.kernels import rotary as R

    switch(monkeypatch, isa=None)
    monkeypatch.setattr(_native, "cpu_tier", lambda: "avx2")
    assert _native.lib("rows") is None
    rms = count_calls(monkeypatch, N, "_rms_native")
    rope = count_calls(monkeypatch, R, "_rotate_native")
    x, w = _gaussian(4, 64), _gaussian(64, seed=1)
    N.rms_norm(x, w, 1e-6, backend="cpu")
    q = _gaussian(1, 3, 2, 64).transpose(1, 2)
    cos, sin = R.rope_cos_sin(torch.ones(32), torch.arange(3)[None], dtype=torch.bfloat16)
    R.apply_rotary(q, q, cos, sin, backend="cpu")
    assert not rms and not rope
