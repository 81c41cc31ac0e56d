"""Qwen3-MoE: Llama's block plus per-head RMSNorm of q and k (over head_dim, before RoPE) and a
sparse MoE MLP (no shared expert); dense layers (Llama's gate/up/down names) per
`mlp_only_layers` / `decoder_sparse_step`."""

import dataclasses

from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import QK_NORM_HEAD, FromConfig, MoeLayout

POLICY = dataclasses.replace(
    LLAMA,
    family="qwen3_moe",
    model_types=("qwen3_moe",),
    block_classes=("Qwen3MoeDecoderLayer",),
    qk_norm=QK_NORM_HEAD,
    moe=MoeLayout(classes=("Qwen3MoeSparseMoeBlock",), num_experts="num_experts",
                  renormalize=FromConfig("norm_topk_prob")),
)
