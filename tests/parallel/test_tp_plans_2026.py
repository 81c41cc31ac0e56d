"""The tensor-parallel plans of gpt-oss and DeepSeek-V3, checked in one process (no process
group): which parameters each rank keeps a slice of, and which stay whole. The torchrun run of
test_tensor_parallel.py (tp_worker.py) checks both against HF eager at tp=2 and tp=3.

gpt-oss: attention Megatron-style (q / k / v and their biases by heads, o_proj by its input with
its bias added once after the all-reduce), the per-head sink logits with their heads, the router
and the experts whole. DeepSeek-V3: the latent attention by heads (q_b_proj / q_proj and kv_b_proj
by output rows, o_proj by its input), the down-projections and their norms whole (every head reads
the one latent), the dense MLPs and the shared experts Megatron-style, the routed experts whole.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import MOE_CONFIGS, make_model
from transformers import AutoModelForCausalLM

from hf_dsinfer.injection.mla import resolve_mla_spec
from hf_dsinfer.injection.policies import find_policy
from hf_dsinfer.parallel.groups import RankGroup
from hf_dsinfer.parallel.plan import linear_styles, plan_block
from hf_dsinfer.parallel.slicing import ShardSpec
from hf_dsinfer.parallel.tensor import plan_model, shard_in_place


def _plans(model, tp: int):
    policy = find_policy(model)
    layers = model.model.layers
    return [[plan_block(layer, policy, model.config, i, tp, r) for i, layer in enumerate(layers)]
            for r in range(tp)]


def test_gpt_oss_plan_slices_attention_and_sinks_keeps_experts_whole():
    model = make_model("gpt_oss")  # 4 query heads of 16, 2 KV heads
    styles, source = linear_styles(find_policy(model), model.config)
    assert source == "policy tp_plan"
    assert styles == {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
                      "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise"}
    for rank, blocks in enumerate(_plans(model, 2)):
        q = (rank * 2 * 16, (rank + 1) * 2 * 16)
        kv = (rank * 16, (rank + 1) * 16)
        for shard in blocks:
            p = shard.params
            assert p["self_attn.sinks"] == ShardSpec(0, ((2 * rank, 2 * rank + 2),))
            assert p["self_attn.q_proj.weight"] == p["self_attn.q_proj.bias"] == ShardSpec(0, (q,))
            assert p["self_attn.k_proj.bias"] == p["self_attn.v_proj.weight"] == ShardSpec(0, (kv,))
            assert p["self_attn.o_proj.weight"] == ShardSpec(1, (q,))
            assert "self_attn.o_proj.bias" not in p  # added once, after the all-reduce
            assert not [n for n in p if n.startswith("mlp.")]  # router and experts whole


def test_deepseek_v3_plan_splits_latent_attention_by_heads():
    model = make_model("deepseek_v3")  # 4 heads: q 16 + 8 wide, k_nope 16 + v 24
    spec = resolve_mla_spec(model.model.layers[0].self_attn, find_policy(model).mla, model.config)
    qw, kvw, vw = spec.nope_dim + spec.rope_dim, spec.nope_dim + spec.v_dim, spec.v_dim
    assert (qw, kvw, vw) == (24, 40, 24)
    for rank, (dense, sparse) in enumerate(_plans(model, 2)):
        heads = (2 * rank, 2 * rank + 2)
        for shard in (dense, sparse):
            p = shard.params
            assert p["self_attn.q_b_proj.weight"] == ShardSpec(0, ((heads[0] * qw, heads[1] * qw),))
            assert p["self_attn.kv_b_proj.weight"] == ShardSpec(
                0, ((heads[0] * kvw, heads[1] * kvw),))
            assert p["self_attn.o_proj.weight"] == ShardSpec(1, ((heads[0] * vw, heads[1] * vw),))
            assert not [n for n in p if "_a_" in n]  # q_a_proj, kv_a_proj_with_mqa, norms whole
        assert dense.params["mlp.gate_proj.weight"] == ShardSpec(0, ((48 * rank, 48 * rank + 48),))
        assert sparse.params["mlp.shared_experts.down_proj.weight"] == ShardSpec(
            1, ((16 * rank, 16 * rank + 16),))
        assert not [n for n in sparse.params if ".experts." in n or n.startswith("mlp.gate.")]


def test_deepseek_v3_full_rank_query_is_split_by_heads():
    """DeepSeek-V2-Lite's variant: one q_proj instead of q_a_proj -> norm -> q_b_proj."""
    config = MOE_CONFIGS["deepseek_v3"]()
    config.q_lora_rank = None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    shard = _plans(model, 2)[1][0]
    assert shard.params["self_attn.q_proj.weight"] == ShardSpec(0, ((48, 96),))
    assert "self_attn.q_b_proj.weight" not in shard.params


@pytest.mark.parametrize("name", ["gpt_oss", "deepseek_v3"])
def test_sliced_blocks_see_their_local_heads(name):
    """After slicing a rank's weights in place, the attention resolves to the local heads (from
    the weights' shapes, not the module's num_heads attribute, which still counts all heads)."""
    model = copy.deepcopy(make_model(name))
    rank1 = RankGroup(None, 1, 2, (0, 1), torch.device("cpu"))  # planning runs no collective
    plan = plan_model(model, find_policy(model), rank1)
    shard_in_place(model, plan)
    attn = model.model.layers[0].self_attn
    if name == "gpt_oss":
        assert attn.sinks.shape == (2,) and attn.q_proj.weight.shape[0] == 2 * 16
    else:
        spec = resolve_mla_spec(attn, find_policy(model).mla, model.config)
        assert spec.num_heads == 2 and attn.num_heads == 4


@pytest.mark.parametrize("name", ["glm4_moe", "ernie4_5_moe_bias", "dots1", "hunyuan_v1_moe"])
def test_glm4_moe_and_ernie_moe_plans_keep_routed_experts_whole(name):
    """GLM-4.5, ERNIE 4.5 MoE, dots.llm1 and HunYuan MoE: attention Megatron-style, the dense
    first layer's MLP and the shared experts sliced, the router and the routed experts whole;
    a biased shared expert's down bias (ERNIE's use_bias) stays whole, added once after the
    all-reduce. HunYuan MoE has no dense layer and names its shared MLP `shared_mlp`."""
    model = make_model(name)
    shared = "mlp.shared_mlp." if name == "hunyuan_v1_moe" else "mlp.shared_experts."
    for blocks in _plans(model, 2):
        for index, shard in enumerate(blocks):
            p = shard.params
            assert p["self_attn.o_proj.weight"].dim == 1
            assert {"self_attn.q_proj.weight", "self_attn.k_proj.weight"} <= set(p)
            assert not [n for n in p if n.startswith(("mlp.experts", "mlp.gate."))]
            prefix = "mlp." if index == 0 and name != "hunyuan_v1_moe" else shared
            weights = {n for n in p if n.startswith("mlp.") and n.endswith("weight")}
            assert weights == {f"{prefix}{n}.weight" for n in ("gate_proj", "up_proj",
                                                               "down_proj")}
            assert f"{prefix}down_proj.bias" not in p
            if name == "ernie4_5_moe_bias":  # column-sliced gate / up carry their biases
                assert f"{prefix}gate_proj.bias" in p
