"""Qwen3-MoE: Llama's block plus per-head RMSNorm of q and k (over head_dim, before RoPE) and a
sparse MoE MLP (no shared expert); dense layers (Llama's gate/up/down names) per
`mlp_only_layers` / `decoder_sparse_step`."""

import dataclasses

from hf_dsinfer.injection.policies.llama import ATTENTION_TP_PLAN, MLP_TP_PLAN
from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import QK_NORM_HEAD, FromConfig, MoeLayout

POLICY = dataclasses.replace(
    LLAMA,
    family="qwen3_moe",
    model_types=("qwen3_moe",),
    block_classes=("Qwen3MoeDecoderLayer",),
    qk_norm=QK_NORM_HEAD,
    # HF's base_model_tp_plan also slices the experts; ours keeps them whole (expert
    # parallelism) and slices attention and the dense layers' MLP. The per-head q/k norm
    # weights [head_dim] and the router are replicated.
    tp_plan={**ATTENTION_TP_PLAN, **MLP_TP_PLAN},
    moe=MoeLayout(classes=("Qwen3MoeSparseMoeBlock",), num_experts="num_experts",
                  renormalize=FromConfig("norm_topk_prob")),
)
