"""The issue-27 MoE families (gpt-oss) through the dense families' grid, plus what is theirs.

The grid of tests/injection/test_family_parity.py runs here on MOE_2026 (gpt-oss, DeepSeek-V3, GLM-4.5) (its test functions are
imported, so they collect again with this module's `pair`): fp32 logits within 1e-4 of HF eager
on a left-padded batch, identical tokens for greedy, padded batches, beams, seeded sampling, the
static cache, no cache and inference_mode, fused calls counted. Prompts (5-9 tokens) and 24 new
tokens run past gpt-oss's 4-token sliding window. tests/moe/test_moe_parity.py covers bf16 (the
parity gate and logits) for every MoE model, these included.

Here: each gpt-oss feature option provably bites (sinks, router and expert biases, the SwiGLU
clamp), DeepSeek-V3's decode runs the absorbed MLA over HF's latent cache, int8 / int4 against HF
on the dequantized weights, and the refusals.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from tiny_models import MOE_2026, MOE_CONFIGS, make_model, prompts
from transformers import AutoModelForCausalLM

import hf_dsinfer
from hf_dsinfer.injection.quantize import QuantizedLinear
from hf_dsinfer.injection.walker import get_report
from hf_dsinfer.kernels.quant import dequantize_int4, dequantize_int8
from hf_dsinfer.parallel.expert import ExpertParallelError, ExpertPlacement, shard_experts
from tests.injection.test_family_parity import (  # noqa: F401  (collected here again)
    FP32_LOGIT_ATOL,
    test_beam_search,
    test_greedy_24_tokens,
    test_inference_mode,
    test_left_padded_batch,
    test_logits_match_hf_eager,
    test_seeded_sampling,
    test_static_cache,
    test_static_cache_logits,
    test_without_cache,
)
from tests.moe.test_moe_parity import _hf_routing_ties

BF16_LOGIT_RTOL = 3e-2
QUANTS = {"int8": {"bits": 8}, "int4": {"bits": 4, "group_size": 32}}


@pytest.fixture(scope="module", params=MOE_2026)
def pair(request):
    ref = make_model(request.param)
    return ref, hf_dsinfer.init_inference(copy.deepcopy(ref), strict=True)


def _logits(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


def test_moe_and_blocks_counted(pair):
    _, fused = pair
    before = hf_dsinfer.fused_call_counts(fused)
    _logits(fused, *prompts())
    after = hf_dsinfer.fused_call_counts(fused)
    moe = get_report(fused).moe  # the MoE modules (mlp, or Granite's block_sparse_moe), fused
    assert moe and all(p in after for p in moe)
    assert all(after[p] == before[p] + 1 for p in before)


def test_gpt_oss_features_bite():
    """Dropping any one of the options (the sinks, the router bias, the expert biases, the
    clamp) moves the logits far past the parity tolerance: the tiny model exercises each."""
    ref = make_model("gpt_oss")
    fused = hf_dsinfer.init_inference(copy.deepcopy(ref), strict=True)
    ids, mask = prompts()
    valid = mask.bool()
    want = _logits(ref, ids, mask)
    assert (want - _logits(fused, ids, mask))[valid].abs().max() <= FP32_LOGIT_ATOL
    report = get_report(fused)
    blocks, moes = list(report.blocks.values()), list(report.moe.values())
    variants = {
        "sinks": [(b, "spec", dataclasses.replace(b.spec, sinks=False)) for b in blocks],
        "clamp": [(m, "spec", dataclasses.replace(m.spec, form=dataclasses.replace(
            m.spec.form, swiglu_limit=1e4))) for m in moes],
        "expert bias": [(m, "spec", dataclasses.replace(m.spec, expert_bias=False))
                        for m in moes],
    }
    for name, patches in variants.items():
        saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
        for obj, attr, value in patches:
            setattr(obj, attr, value)
        try:
            got = _logits(fused, ids, mask)
        finally:
            for obj, attr, value in saved:
                setattr(obj, attr, value)
        assert (want - got)[valid].abs().max() > 1e-2, name
    router_bias = [m.router.bias for m in moes]
    with torch.no_grad():
        saved = [b.clone() for b in router_bias]
        for b in router_bias:
            b.zero_()
        try:
            got = _logits(fused, ids, mask)
        finally:
            for b, s in zip(router_bias, saved):
                b.copy_(s)
    assert (want - got)[valid].abs().max() > 1e-2, "router bias"


def _dequantized_copy(ref: torch.nn.Module, fused: torch.nn.Module) -> torch.nn.Module:
    """`ref` with every weight the fused model quantized replaced by its dequantized value, the
    experts back in their HF form (gpt-oss: transposed, [E, H, 2I] / [E, I, H])."""
    out = copy.deepcopy(ref)
    dtype = next(ref.parameters()).dtype
    with torch.no_grad():
        for path, module in fused.named_modules():
            if isinstance(module, QuantizedLinear) and ".dsinfer_quantized." not in path:
                out.get_submodule(path).weight.copy_(_dequantize(module, dtype))
        for path, moe in get_report(fused).moe.items():
            experts = out.get_submodule(path).experts
            weights = [_dequantize(q, dtype) for q in moe.quantized]  # nn.Linear [out, in]
            if moe.spec.form.transposed:
                weights = [w.t() for w in weights]
            experts.gate_up_proj.copy_(torch.stack(weights[0::2]))
            experts.down_proj.copy_(torch.stack(weights[1::2]))
    return out


def _dequantize(q: QuantizedLinear, dtype: torch.dtype) -> torch.Tensor:
    return (dequantize_int8 if q.bits == 8 else dequantize_int4)(q.quantized, dtype)


def _quantized_pair(name: str, quant: str, dtype: torch.dtype):
    ref = make_model(name, dtype=dtype)
    fused = hf_dsinfer.init_inference(copy.deepcopy(ref), quant=QUANTS[quant], strict=True)
    moe = next(iter(get_report(fused).moe.values()))
    assert moe.quantized is not None and not hasattr(moe.experts, "gate_up_proj")
    assert all(q.bits == QUANTS[quant]["bits"] for q in moe.quantized)
    if moe.spec.expert_bias:  # the biases moved into the quantized linears, unquantized
        assert all(q.bias is not None for q in moe.quantized)
    return _dequantized_copy(ref, fused), fused


@pytest.mark.parametrize("quant", list(QUANTS))
@pytest.mark.parametrize("name", MOE_2026)
def test_quantized_matches_hf_on_dequantized_weights(name, quant):
    """fp32: every quantized linear (experts, shared experts, attention, dense MLPs) computes
    what HF computes with the dequantized weights, to 1e-4; bf16: the same within bf16 rounding
    on the tokens whose routing is no near-tie, and greedy decoding runs fused."""
    ref, fused = _quantized_pair(name, quant, torch.float32)
    ids, mask = prompts()
    calls = sum(hf_dsinfer.fused_call_counts(fused).values())
    a, b = _logits(ref, ids, mask), _logits(fused, ids, mask)
    assert sum(hf_dsinfer.fused_call_counts(fused).values()) > calls
    assert (a - b)[mask.bool()].abs().max() <= FP32_LOGIT_ATOL
    ref, fused = _quantized_pair(name, quant, torch.bfloat16)
    a, b = _logits(ref, ids, mask).float(), _logits(fused, ids, mask).float()
    valid = mask.bool() & ~_hf_routing_ties(ref, fused, ids, mask)  # bf16 may flip those
    assert valid.sum() >= mask.sum() * 2 // 3, "too many near-ties to test anything"
    err = (a[valid] - b[valid]).abs().max() / a[valid].abs().max()
    assert err <= BF16_LOGIT_RTOL, err.item()
    gen = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert fused.generate(ids, attention_mask=mask, **gen).shape[1] == ids.shape[1] + 6


def test_biased_experts_are_not_sliced():
    """Expert slicing would add the down-projection bias once per slice: refused."""
    fused = hf_dsinfer.init_inference(make_model("gpt_oss"))
    moe = next(iter(get_report(fused).moe.values()))
    with pytest.raises(ExpertParallelError, match="only sharded whole"):
        shard_experts(moe, ExpertPlacement(num_experts=8, ep_size=16, rank=0))
    shard_experts(moe, ExpertPlacement(num_experts=8, ep_size=2, rank=1))  # whole: experts 4-7
    assert moe.experts.gate_up_proj.shape[0] == moe.experts.down_proj_bias.shape[0] == 4


def test_deepseek_v3_decode_reads_the_latent_cache_absorbed():
    """Decode steps run the absorbed MLA over the latent as HF caches it ([B, 1, S, r] latent,
    [B, 1, S, dr] rotary key, HF's own shapes and values), and the tokens stay HF's."""
    ref = make_model("deepseek_v3")
    fused = hf_dsinfer.init_inference(copy.deepcopy(ref), strict=True)
    blocks = list(get_report(fused).blocks.values())
    ids, mask = prompts(batch=2)
    gen = {"max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False, "pad_token_id": 0,
           "return_dict_in_generate": True}
    before = [f.mla.absorbed_calls for f in blocks]  # the parity probe's step included
    a, b = (m.generate(ids, attention_mask=mask, **gen) for m in (ref, fused))
    assert torch.equal(a.sequences, b.sequences)
    assert [f.mla.absorbed_calls - n for f, n in zip(blocks, before)] == [4] * len(blocks)
    spec = blocks[0].mla.spec
    valid = torch.cat([mask, torch.ones(2, 4, dtype=mask.dtype)], dim=1).bool()  # not padding
    for la, lb in zip(a.past_key_values.layers, b.past_key_values.layers):
        assert lb.keys.shape == (2, 1, ids.shape[1] + 4, spec.latent_dim)
        assert lb.values.shape == (2, 1, ids.shape[1] + 4, spec.rope_dim)
        assert (la.keys - lb.keys)[:, 0][valid].abs().max() <= 1e-5
        assert (la.values - lb.values)[:, 0][valid].abs().max() <= 1e-5


def test_deepseek_v3_full_rank_query_and_rotate_half_rope():
    """DeepSeek-V2-Lite's variant: one q_proj (q_lora_rank None), rotary dims not interleaved."""
    config = MOE_CONFIGS["deepseek_v3"]()
    config.q_lora_rank, config.rope_interleave = None, False
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    fused = hf_dsinfer.init_inference(copy.deepcopy(ref), strict=True)
    assert not next(iter(get_report(fused).blocks.values())).mla.spec.low_rank_q
    ids, mask = prompts()
    assert (_logits(ref, ids, mask) - _logits(fused, ids, mask))[mask.bool()].abs().max() \
        <= FP32_LOGIT_ATOL
    gen = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(ref.generate(ids, attention_mask=mask, **gen),
                       fused.generate(ids, attention_mask=mask, **gen))


@pytest.mark.parametrize("use_qk_norm", [True, False])
def test_glm4_moe_qk_norms_follow_the_config(use_qk_norm):
    """GLM-4.5's q / k norms exist where the config says use_qk_norm (the policy's qk_norm is
    read from the config per model): both configurations keep HF eager's logits and tokens,
    with the fused blocks and the MoE layer counted."""
    config = MOE_CONFIGS["glm4_moe"]()
    config.use_qk_norm = use_qk_norm
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    fused = hf_dsinfer.init_inference(copy.deepcopy(ref), strict=True)
    blocks = list(get_report(fused).blocks.values())
    assert [b.spec.qk_norm for b in blocks] == ["per_head" if use_qk_norm else None] * 2
    ids, mask = prompts()
    before = sum(hf_dsinfer.fused_call_counts(fused).values())
    assert (_logits(ref, ids, mask) - _logits(fused, ids, mask))[mask.bool()].abs().max() \
        <= FP32_LOGIT_ATOL
    assert sum(hf_dsinfer.fused_call_counts(fused).values()) > before
    gen = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(ref.generate(ids, attention_mask=mask, **gen),
                       fused.generate(ids, attention_mask=mask, **gen))


@pytest.mark.parametrize("norm_min", [1e-12, 0.9])  # ERNIE's floor, and one that clamps
def test_ernie_moe_routing_is_hfs_router(norm_min):
    """softmax_biased: the chosen experts and weights of HF's Ernie4_5_MoeTopKRouter, to the
    bit (fp32 weights, then bf16 ones through FusedMoE.route), with a correction bias that
    moves the choice; the floor of the renormalization applies where it clamps."""
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter

    from hf_dsinfer.kernels.moe_routing import softmax_biased_topk

    config = MOE_CONFIGS["ernie4_5_moe"]()
    config.moe_norm_min = norm_min
    router = Ernie4_5_MoeTopKRouter(config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.normal_(0, 0.5, generator=gen)
        router.moe_statics.e_score_correction_bias.normal_(0, 0.1, generator=gen)
    x = torch.randn(64, config.hidden_size, generator=gen)
    _, want_w, want_ids = router(x)
    logits = torch.nn.functional.linear(x, router.weight)
    bias = router.moe_statics.e_score_correction_bias
    weights, ids = softmax_biased_topk(logits, bias, config.num_experts_per_tok, norm_min)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
    plain = softmax_biased_topk(logits, torch.zeros_like(bias), config.num_experts_per_tok,
                                norm_min)[1]
    assert not torch.equal(plain, ids)  # the bias steers the choice
    sums = torch.softmax(logits, -1).gather(1, ids).sum(-1)
    assert (sums < norm_min).any() == (norm_min > 0.5)  # the floor clamps some rows, or none

    model = make_model("ernie4_5_moe", dtype=torch.bfloat16)
    fused = hf_dsinfer.init_inference(copy.deepcopy(model), strict=True)
    moe = next(iter(get_report(fused).moe.values()))
    hf_router = model.model.layers[1].mlp.gate
    xb = torch.randn(16, 64, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        w, i = moe.route(xb)
        _, hf_w, hf_i = hf_router(xb)
    assert w.dtype == torch.bfloat16 and torch.equal(i, hf_i) and torch.equal(w, hf_w)


def test_minimax_m2_routing_is_hfs_router():
    """MiniMax-M2: HF's MiniMaxM2TopKRouter's experts and fp32 weights through FusedMoE.route,
    to the bit, in bf16 (a bf16 router GEMM, then fp32 sigmoid scores) and fp32. The correction
    bias lives on the MoE block, not the router, and steers the choice; scoring the bf16 logits
    in bf16 would round the weights otherwise."""
    from hf_dsinfer.kernels.moe_routing import sigmoid_group_topk

    gen = torch.Generator().manual_seed(4)
    for dtype in (torch.bfloat16, torch.float32):
        model = make_model("minimax_m2", dtype=dtype)
        block = model.model.layers[1].mlp
        with torch.no_grad():
            block.e_score_correction_bias.normal_(0, 0.2, generator=gen)
        fused = hf_dsinfer.init_inference(copy.deepcopy(model), strict=True)
        moe = next(m for p, m in get_report(fused).moe.items() if p.startswith("model.layers.1."))
        x = torch.randn(64, 64, generator=gen).to(dtype)
        with torch.no_grad():
            w, i = moe.route(x)
            logits, hf_w, hf_i = block.gate(x, block.e_score_correction_bias)
        assert w.dtype == torch.float32 and torch.equal(i, hf_i) and torch.equal(w, hf_w)
        plain = sigmoid_group_topk(logits, torch.zeros(8), 3, 1, 1, True, 1.0)[1]
        assert not torch.equal(plain.sort(-1).values, i.sort(-1).values)  # the bias steers
        if dtype == torch.bfloat16:
            low = logits.sigmoid().float().gather(1, i)
            assert not torch.equal(low / low.sum(-1, keepdim=True), w)  # fp32 scores count


def test_hunyuan_moe_routing_is_hfs_gate_per_layer():
    """HunYuan MoE: each layer's k is its router's (HF resolves the list form of moe_topk
    per layer: 3 then 2 here), and FusedMoE.route gives HF's HunYuanMoEV1Gate experts and
    weights to the bit in a bf16 model, whose router Linear `gate.wg` HF keeps in fp32 (the
    GEMM in fp32, fp32 weights)."""
    model = make_model("hunyuan_v1_moe", dtype=torch.bfloat16)
    assert model.model.layers[0].mlp.gate.wg.weight.dtype == torch.float32
    fused = hf_dsinfer.init_inference(copy.deepcopy(model), strict=True)
    moes = sorted(get_report(fused).moe.items())
    assert [m.spec.top_k for _, m in moes] == [3, 2]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(32, 64, generator=gen).to(torch.bfloat16)
    for layer, (_, moe) in zip(model.model.layers, moes, strict=True):
        with torch.no_grad():
            w, i = moe.route(x)
            _, hf_w, hf_i = layer.mlp.gate(x)
        assert w.dtype == torch.float32 and torch.equal(i, hf_i) and torch.equal(w, hf_w)


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v2_grouped"])
def test_deepseek_v2_routing_is_hfs_router(name):
    """DeepSeek-V2: HF's DeepseekV2TopkRouter's experts and fp32 weights through FusedMoE.route,
    to the bit, in bf16 and fp32: greedy top-k over every expert (V2-Lite), and top-k within
    the topk_group groups of the best single probabilities (V2); routed scaling applied, no
    renormalization. The groups bite: top-k over every expert picks others."""
    from hf_dsinfer.kernels.moe_routing import softmax_group_topk

    gen = torch.Generator().manual_seed(6)
    for dtype in (torch.bfloat16, torch.float32):
        model = make_model(name, dtype=dtype)
        gate = model.model.layers[1].mlp.gate
        fused = hf_dsinfer.init_inference(copy.deepcopy(model), strict=True)
        (moe,) = get_report(fused).moe.values()
        x = torch.randn(64, 64, generator=gen).to(dtype)
        with torch.no_grad():
            w, i = moe.route(x)
            logits, hf_w, hf_i = gate(x)
        assert w.dtype == torch.float32 and torch.equal(i, hf_i) and torch.equal(w, hf_w)
        assert moe.spec.routed_scaling == 1.5
        if name == "deepseek_v2_grouped":
            greedy = softmax_group_topk(logits, 3, 1, 1, 1.5)[1]
            assert not torch.equal(greedy.sort(-1).values, i.sort(-1).values)


def _variant(name: str):
    """(HF model, fused copy, injection report) of a MoE variant outside the grid."""
    ref = make_model(name)
    fused = hf_dsinfer.init_inference(copy.deepcopy(ref), strict=True)
    return ref, fused, get_report(fused)


def _fp32_and_greedy_match(ref, fused, report):
    """fp32 logits of HF eager (to FP32_LOGIT_ATOL) and its greedy tokens on a left-padded
    batch, every MoE fused; returns (ids, mask, HF's logits)."""
    ids, mask = prompts()
    a, b = _logits(ref, ids, mask), _logits(fused, ids, mask)
    assert (a - b)[mask.bool()].abs().max() <= FP32_LOGIT_ATOL
    gen = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        assert torch.equal(fused.generate(ids, attention_mask=mask, **gen),
                           ref.generate(ids, attention_mask=mask, **gen))
    assert all(m.calls > 0 for m in report.moe.values())
    return ids, mask, a


def test_deepseek_v2_grouped_matches_hf():
    """The group-limited variant with a low-rank query (DeepSeek-V2's own layout): fp32 logits
    and greedy tokens of HF eager, the fused MoE and the absorbed MLA decode counted."""
    ref, fused, report = _variant("deepseek_v2_grouped")
    assert all(b.mla.spec.low_rank_q for b in report.blocks.values())
    before = [b.mla.absorbed_calls for b in report.blocks.values()]  # the parity gate's step
    _fp32_and_greedy_match(ref, fused, report)
    assert [b.mla.absorbed_calls - n for b, n in zip(report.blocks.values(), before)] == [5, 5]


def test_granitemoe_swa_matches_hf_in_fp32():
    """Granite MoE SWA (sinks, sliding / full layers with the full one NoPE, Granite's
    multipliers, a MoE with a shared MLP beside its experts in every layer): fp32 logits of HF
    eager, greedy tokens, every block and MoE fused; without the shared MLP the logits move."""
    ref, fused, report = _variant("granitemoe_swa")
    assert all(b._moe_shared is b.block.shared_mlp and b.spec.sinks
               for b in report.blocks.values())
    ids, mask, a = _fp32_and_greedy_match(ref, fused, report)
    for block in report.blocks.values():
        block._moe_shared = None
    assert (_logits(fused, ids, mask) - a)[mask.bool()].abs().max() > 1e-2
