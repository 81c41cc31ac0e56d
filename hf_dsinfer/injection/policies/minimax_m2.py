"""MiniMax-M2 (`minimax_m2`): Llama's pre-norm block with RMSNorm over the whole q and k
projections before the head split (OLMoE's q / k norm), RoPE on the first
`partial_rotary_factor` of each head, and a sparse MoE in every layer: a router GEMM in the
weights' dtype, fp32 sigmoid scores, a correction bias on the MoE block steering the choice of
the top-k, the chosen scores renormalized by their sum and kept in fp32 (DeepSeek-V3's router
with one group and no scaling). Tensor parallelism slices attention by heads with the q / k
norm weights (the sum of squares all-reduced, as OLMoE) and keeps the experts whole (ep_size
shards them); HF's plan gathers q / k / v back to full width and slices the experts."""

import dataclasses

from hf_dsinfer.injection.policies.llama import ATTENTION_TP_PLAN
from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import QK_NORM_FULL, MoeLayout

POLICY = dataclasses.replace(
    LLAMA,
    family="minimax_m2",
    model_types=("minimax_m2",),
    block_classes=("MiniMaxM2DecoderLayer",),
    mlp_in=(),
    mlp_out="",
    qk_norm=QK_NORM_FULL,
    tp_plan=ATTENTION_TP_PLAN,
    moe=MoeLayout(classes=("MiniMaxM2SparseMoeBlock",), num_experts="num_local_experts",
                  renormalize=True, fp32_weights=True, scoring="sigmoid_group",
                  correction_bias="e_score_correction_bias",
                  router_args=("e_score_correction_bias",), n_group=1, topk_group=1,
                  routed_scaling=1.0),
)
