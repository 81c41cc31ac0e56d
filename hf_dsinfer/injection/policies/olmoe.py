"""OLMoE: Llama's block with RMSNorm over the whole q and k projections (not per head) before the
head split, an optional clamp of q/k/v to +-clip_qkv, and a sparse MoE MLP in every layer (no
dense linears: mlp_in / mlp_out empty)."""

import dataclasses

from hf_dsinfer.injection.policies.llama import ATTENTION_TP_PLAN
from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import QK_NORM_FULL, FromConfig, MoeLayout

POLICY = dataclasses.replace(
    LLAMA,
    family="olmoe",
    model_types=("olmoe",),
    block_classes=("OlmoeDecoderLayer",),
    mlp_in=(),
    mlp_out="",
    qk_norm=QK_NORM_FULL,
    clip_qkv=FromConfig("clip_qkv"),
    # HF's base_model_tp_plan gathers q/k/v back to full width (colwise_gather_output) for this
    # norm and slices the experts; ours slices attention by heads, slices the q/k norm weights
    # with q and k and all-reduces the sum of squares (parallel/plan.py), keeps experts whole.
    tp_plan=ATTENTION_TP_PLAN,
    moe=MoeLayout(classes=("OlmoeSparseMoeBlock",), num_experts="num_experts",
                  renormalize=FromConfig("norm_topk_prob")),
)
