"""Mixtral: Llama's block (GQA, sliding window via HF's masks) with a sparse MoE MLP: softmax in
fp32 over all experts, top-k, renormalized, routing weights kept in fp32. The MoE module holds
no dense linears (mlp_in / mlp_out empty)."""

import dataclasses

from hf_dsinfer.injection.policies.llama import ATTENTION_TP_PLAN
from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import MoeLayout

POLICY = dataclasses.replace(
    LLAMA,
    family="mixtral",
    model_types=("mixtral",),
    block_classes=("MixtralDecoderLayer",),
    mlp_in=(),
    mlp_out="",
    # HF's base_model_tp_plan also slices the experts (packed_colwise / rowwise); ours keeps
    # them whole for expert parallelism and slices attention only (the router is replicated).
    tp_plan=ATTENTION_TP_PLAN,
    moe=MoeLayout(classes=("MixtralSparseMoeBlock",), num_experts="num_local_experts",
                  renormalize=True, fp32_weights=True),
)
