"""DeepSeek-V2 (`deepseek_v2`: DeepSeek-V2, V2-Lite, DeepSeek-Coder-V2): DeepSeek-V3's block
(multi-head latent attention over HF's latent cache, absorbed decode; dense first layers, then a
MoE with ungated shared experts) with V2's own pieces, as options:
- the query is one q_proj where q_lora_rank is None (V2-Lite), else low-rank as V3's;
- RoPE is a complex product by HF's `freqs_cis` (position_embeddings), in fp32, the pairs kept
  interleaved (`MlaLayout.rope_complex`);
- routing (`scoring="softmax_group"`): an fp32 router GEMM and softmax, top-k over every expert
  (`topk_method="greedy"`) or within the topk_group groups of the best single probabilities
  (`group_limited_greedy`), weights times routed_scaling_factor, fp32, no renormalization.
Tensor parallelism splits MLA by heads and the dense MLPs and shared experts Megatron-style, as
DeepSeek-V3's; ep_size shards the routed experts."""

import dataclasses

from hf_dsinfer.injection.policies.deepseek_v3 import POLICY as V3
from hf_dsinfer.injection.policy import FromConfig, MlaLayout, MoeLayout

POLICY = dataclasses.replace(
    V3,
    family="deepseek_v2",
    model_types=("deepseek_v2",),
    block_classes=("DeepseekV2DecoderLayer",),
    mla=MlaLayout(rope_complex=True),
    moe=MoeLayout(classes=("DeepseekV2Moe",), num_experts="n_routed_experts",
                  renormalize=False, fp32_weights=True, shared_expert="shared_experts",
                  scoring="softmax_group",
                  group_limited=FromConfig("topk_method", {"greedy": False,
                                                           "group_limited_greedy": True}),
                  n_group=FromConfig("n_group"), topk_group=FromConfig("topk_group"),
                  routed_scaling=FromConfig("routed_scaling_factor"), router_fp32=True),
)
