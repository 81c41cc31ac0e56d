"""DeepSeek-V3: Llama's pre-norm block with multi-head latent attention (low-rank q with its
RMSNorm, a KV latent with its RMSNorm plus one shared rotary key, RoPE on the rotary dims only,
in interleaved pairs per config.rope_interleave; the HF cache holds the latent) and, from layer
`first_k_dense_replace` on, a sparse MoE: sigmoid scores, a correction bias that steers the
choice, top-k within the topk_group best of n_group expert groups, weights renormalized and
times routed_scaling_factor (fp32 router GEMM, fp32 weights), plus ungated shared experts. The
first layers are dense gated MLPs (Llama's names, also the shared experts'). Tensor parallelism
splits MLA by heads (the query's last projection and kv_b_proj by output rows, o_proj by input;
the down-projections, their norms and so the latent cache replicated), the dense MLPs and the
shared experts Megatron-style; the routed experts stay whole (HF's plan slices them): ep_size
shards them."""

import dataclasses

from hf_dsinfer.injection.policies.llama import MLP_TP_PLAN, SHARED_EXPERTS_TP_PLAN
from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import FromConfig, MlaLayout, MoeLayout

POLICY = dataclasses.replace(
    LLAMA,
    family="deepseek_v3",
    model_types=("deepseek_v3",),
    block_classes=("DeepseekV3DecoderLayer",),
    qkv=(),
    mla=MlaLayout(rope_interleave=FromConfig("rope_interleave", default=False)),
    tp_plan={"self_attn.q_proj": "colwise", "self_attn.q_b_proj": "colwise",
             "self_attn.kv_b_proj": "colwise", "self_attn.o_proj": "rowwise", **MLP_TP_PLAN,
             **SHARED_EXPERTS_TP_PLAN},
    moe=MoeLayout(classes=("DeepseekV3MoE",), num_experts="n_routed_experts",
                  renormalize=FromConfig("norm_topk_prob"), fp32_weights=True,
                  shared_expert="shared_experts", scoring="sigmoid_group",
                  correction_bias="gate.e_score_correction_bias", n_group=FromConfig("n_group"),
                  topk_group=FromConfig("topk_group"),
                  routed_scaling=FromConfig("routed_scaling_factor"), router_fp32=True),
)
