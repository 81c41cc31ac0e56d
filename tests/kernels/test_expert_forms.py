"""kernels.expert_forms and the attention-sink option against HF's own gpt-oss modules, on odd
shapes: GptOssExperts (transposed, interleaved, biased, clamped SwiGLU) and gpt-oss's
eager_attention_forward (a sink logit per head), fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig
from transformers.models.gpt_oss import modeling_gpt_oss as hf

from hf_dsinfer.kernels.attention import attention
from hf_dsinfer.kernels.expert_forms import (
    ExpertForm,
    ExpertTensors,
    form_expert_mlp,
    form_expert_rows,
)
from hf_dsinfer.kernels.moe import moe_align
from tests.kernels.conftest import REDUCTION_TOL, assert_close_tol

DTYPES = (torch.float32, torch.bfloat16)
SHAPES = [(13, 24, 10, 5, 3), (1, 40, 6, 4, 4)]  # tokens, hidden, intermediate, experts, top-k


def _hf_experts(hidden: int, inter: int, experts: int, dtype: torch.dtype):
    config = GptOssConfig(hidden_size=hidden, intermediate_size=inter,
                          num_local_experts=experts, swiglu_limit=0.7)
    config._experts_implementation = "eager"  # HF's loop, the reference
    module = hf.GptOssExperts(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return module.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_form_expert_mlp_matches_gpt_oss_experts(shape, dtype):
    t, h, i, e, k = shape
    module = _hf_experts(h, i, e, dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(t, h, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])  # [T, k]
    weights = torch.softmax(torch.randn(t, k, generator=gen), -1).to(dtype)
    form = ExpertForm(transposed=True, interleaved=True, swiglu_alpha=module.alpha,
                      swiglu_limit=module.limit)
    tensors = ExpertTensors(module.gate_up_proj, module.down_proj, module.gate_up_proj_bias,
                            module.down_proj_bias)
    with torch.no_grad():
        want = module.forward(x, ids, weights)
        got = form_expert_mlp(x, tensors, weights, ids, form)
        align = moe_align(ids, e)
        rows = form_expert_rows(x.index_select(0, align.token_idx), tensors,
                                align.expert_offsets, form)
    assert_close_tol(got, want)
    # rows: unweighted; weighting and summing them gives the mixture again
    inverse = torch.empty_like(align.flat_idx)
    inverse[align.flat_idx] = torch.arange(len(inverse))
    mixed = (rows.index_select(0, inverse).view(t, k, -1) * weights[..., None]).sum(1)
    assert_close_tol(mixed.to(dtype), want, table=REDUCTION_TOL)


def test_clamped_swiglu_form_needs_alpha_and_limit():
    with pytest.raises(ValueError, match="both alpha and limit"):
        ExpertForm(swiglu_alpha=1.7)


class _Sinks(torch.nn.Module):
    def __init__(self, sinks: torch.Tensor, groups: int):
        super().__init__()
        self.sinks, self.num_key_value_groups = sinks, groups


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq", [1, 7])
def test_attention_sinks_match_gpt_oss_eager(sq, dtype):
    b, hq, hkv, sk, d = 2, 6, 2, 11, 16
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(b, hq, sq, d, generator=gen).to(dtype)
    k, v = (torch.randn(b, hkv, sk, d, generator=gen).to(dtype) for _ in range(2))
    sinks = (2 * torch.randn(hq, generator=gen)).to(dtype)
    keep = torch.ones(b, 1, sq, sk, dtype=torch.bool).tril(sk - sq)  # causal, bottom-right
    keep[0, ..., :3] = False  # left padding of row 0
    mask = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)
    want, _ = hf.eager_attention_forward(_Sinks(sinks, hq // hkv), q, k, v, mask, scaling=0.3)
    got = attention(q, k, v, scale=0.3, mask=mask, sinks=sinks, backend="cpu")
    assert_close_tol(got.transpose(1, 2), want, table=REDUCTION_TOL)
    plain = attention(q, k, v, scale=0.3, mask=mask, backend="cpu")
    assert (plain.float() - got.float()).abs().max() > 1e-2  # the sinks take their share
