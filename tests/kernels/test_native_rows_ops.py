"""RMSNorm and SiLU(gate) * up of many bf16 rows by the native decode layer's code
(kernels/norms.py: rms_norm_cpu -> hfd_rms_rows_bf16; kernels/activations.py: gated_act_cpu ->
hfd_silu_mul_bf16): HF's eager roundings, so the eager reference's bits but for a rare last-bit
flip where torch's own reductions or exp round otherwise (they move with its CPU capability);
the same bits at every ISA tier; counted; other calls keep torch's ops."""

from __future__ import annotations

import pytest
import torch
from switches import switch

from hf_dsinfer.kernels import _native
from hf_dsinfer.kernels import activations as A
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


@pytest.mark.parametrize("shape", [(1, 1536), (3, 7, 2048), (5, 100)])
def test_silu_mul_is_hfs(monkeypatch, shape):
    g, u = _gaussian(*shape, seed=4, scale=3.0), _gaussian(*shape, seed=5)
    calls = count_calls(monkeypatch, A, "_silu_mul_native")
    out = A.gated_act(g, u, "silu", backend="cpu")
    assert len(calls) == 1
    _nearly_equal(out, A.gated_act_ref(g, u, "silu"))


def test_every_tier_computes_the_same_bits(monkeypatch):
    x, w = _gaussian(9, 320, seed=6), (_gaussian(320, seed=7, scale=0.3).float() + 1).bfloat16()
    g, u = _gaussian(9, 320, seed=8, scale=3.0), _gaussian(9, 320, seed=9)
    best = _native.cpu_tier()
    outs = []
    for tier in _native.TIERS[: _native.TIERS.index(best) + 1]:
        switch(monkeypatch, isa=tier)
        outs.append(torch.cat([N.rms_norm(x, w, 1e-5, backend="cpu")[0],
                               A.gated_act(g, u, "silu", backend="cpu")]))
    assert all(torch.equal(outs[0], o) for o in outs)


def test_other_calls_keep_torchs_ops(monkeypatch):
    rms = count_calls(monkeypatch, N, "_rms_native")
    act = count_calls(monkeypatch, A, "_silu_mul_native")
    x, w = _gaussian(4, 64), _gaussian(64, seed=1)
    for style in ("fp32", "gemma"):  # their fp32 multiply: torch's ops
        assert torch.equal(N.rms_norm(x, w, 1e-6, backend="cpu", style=style)[0],
                           N.rms_norm_cpu(x, w, 1e-6, style=style)[0])
    N.rms_norm(x.float(), w.float(), 1e-6, backend="cpu")  # fp32
    N.rms_norm(x.t(), _gaussian(4, seed=2), 1e-6, backend="cpu")  # not contiguous
    g, u = _gaussian(4, 64, seed=3), _gaussian(4, 64, seed=4)
    A.gated_act(g, u, "gelu_tanh", backend="cpu")  # Gemma's: torch's ops
    A.gated_act(torch.cat([g, u], -1), None, "silu", backend="cpu")  # packed gate_up
    A.gated_act(g.float(), u.float(), "silu", backend="cpu")
    A.gated_act(g, u, "silu", backend="ref")
    assert not rms and not act
