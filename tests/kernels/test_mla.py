"""kernels.mla: the absorbed attention over the latent equals the expanded (HF-order) one, on
odd shapes, one query (decode) and several (prefill, causal and masked), fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from hf_dsinfer.kernels.mla import mla_attention_absorbed, mla_attention_expanded
from tests.kernels.conftest import REDUCTION_TOL, assert_close_tol

# batch, heads, queries, keys, nope dims, rope dims, v dims, latent rank
SHAPES = [(2, 3, 1, 9, 12, 4, 10, 20), (1, 5, 6, 6, 16, 8, 24, 40), (3, 2, 4, 11, 8, 6, 8, 12)]


def _inputs(shape, dtype):
    """q_nope, q_rot, latent, rotary key, kv_b_proj weight, dv."""
    b, nh, sq, sk, dn, dr, dv, r = shape
    gen = torch.Generator().manual_seed(sum(shape))
    sizes = [(b, nh, sq, dn), (b, nh, sq, dr), (b, 1, sk, r), (b, 1, sk, dr), (nh * (dn + dv), r)]
    *acts, w = (torch.randn(size, generator=gen) for size in sizes)
    return (*(t.to(dtype) for t in acts), (w / r ** 0.5).to(dtype), dv)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("shape", SHAPES)
def test_absorbed_equals_expanded(shape, dtype):
    q_nope, q_rot, kv, k_rot, w, dv = _inputs(shape, dtype)
    b, sq, sk = shape[0], shape[2], shape[3]
    keep = torch.ones(b, 1, sq, sk, dtype=torch.bool).tril(sk - sq)
    keep[-1, ..., :2] = False  # left padding of the last row
    mask = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)
    for kwargs in ({"mask": mask}, {"mask": keep}, {"causal": sq > 1}):
        want = mla_attention_expanded(q_nope, q_rot, kv, k_rot, w, dv=dv, scale=0.2, **kwargs)
        got = mla_attention_absorbed(q_nope, q_rot, kv, k_rot, w, dv=dv, scale=0.2, **kwargs)
        assert got.shape == (b, shape[1], sq, dv)
        assert_close_tol(got, want, table=REDUCTION_TOL)
