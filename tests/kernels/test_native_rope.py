"""The native rotation of many tokens (kernels/rotary.py: apply_rotary_cpu ->
csrc/cpu_decode.c: hfd_rope_rows_bf16): bf16 rotate-half q / k whose heads are contiguous per
token (the fused blocks' projections) rotated with the reference's bits (HF's eager
apply_rotary_pos_emb), full and partial rotary, GQA, one token or many, at every ISA tier;
counted; the calls it does not take keep the reference."""

from __future__ import annotations

import pytest
import torch

from hf_dsinfer.kernels import _native
from hf_dsinfer.kernels import rotary as R
from tests.kernels.conftest import count_calls

pytestmark = [pytest.mark.skipif(not _native.builds(),
               reason=f"native CPU kernels unavailable: {_native.why_unavailable()}"),
              pytest.mark.usefixtures("native_tier")]


def _qk(b, s, hq, hk, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, hq, d, generator=gen).bfloat16().transpose(1, 2)  # [B, H, S, D]
    k = torch.randn(b, s, hk, d, generator=gen).bfloat16().transpose(1, 2)
    return q, k


def _cos_sin(b, s, rot, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, rot, 2).float() / rot))
    pos = torch.arange(s)[None].repeat(b, 1) + 5
    pos[-1] = (pos[-1] - 3).clamp(min=0)  # a left-padded row restarts its positions
    return R.rope_cos_sin(inv, pos, dtype=torch.bfloat16)


@pytest.mark.parametrize("b,s,hq,hk,d,rot", [(1, 1, 4, 2, 64, 64), (2, 7, 6, 3, 80, 80),
                                             (1, 11, 4, 1, 256, 256), (2, 5, 8, 8, 96, 48),
                                             (3, 2, 2, 2, 128, 32)])
def test_native_rotation_is_the_references_bits(monkeypatch, b, s, hq, hk, d, rot):
    q, k = _qk(b, s, hq, hk, d)
    cos, sin = _cos_sin(b, s, rot)
    calls = count_calls(monkeypatch, R, "_rotate_native")
    got = R.apply_rotary(q, k, cos, sin, backend="cpu")
    assert len(calls) == 2  # q and k
    want = R.apply_rotary_ref(q, k, cos, sin)
    for g, w, x in zip(got, want, (q, k)):
        assert torch.equal(g, w) and g.stride() == x.stride()
    assert not torch.equal(got[0], q)  # copies: the inputs stay as they were
    assert torch.equal(q, _qk(b, s, hq, hk, d)[0])


def test_calls_it_does_not_take_keep_the_reference(monkeypatch):
    calls = count_calls(monkeypatch, R, "_rotate_native")
    q, k = _qk(2, 5, 4, 2, 64)
    cos, sin = _cos_sin(2, 5, 64)
    R.apply_rotary(q, k, cos, sin, interleaved=True, backend="cpu")  # GPT-J's pairs
    R.apply_rotary(q.float(), k.float(), cos.float(), sin.float(), backend="cpu")  # fp32
    R.apply_rotary(q.contiguous(), k.contiguous(), cos, sin, backend="cpu")  # heads apart
    R.apply_rotary(q, k, cos[:1].expand(2, -1, -1), sin[:1].expand(2, -1, -1),
                   backend="cpu")  # broadcast tables
    R.apply_rotary(q, k, cos, sin, backend="ref")
    assert not calls
