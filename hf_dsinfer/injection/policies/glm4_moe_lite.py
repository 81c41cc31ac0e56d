"""GLM-4.7-Flash (`glm4_moe_lite`): DeepSeek-V3's block under GLM's names: multi-head latent
attention (low-rank q, the HF cache holding the latent, interleaved RoPE per
config.rope_interleave) and, on the layers `mlp_layer_types` calls sparse, GLM-4.5's MoE
(DeepSeek-V3's routing and shared experts); the other layers are dense gated MLPs. Tensor
parallelism splits MLA by heads and the dense MLPs and shared experts Megatron-style; the
routed experts stay whole (ep_size shards them)."""

import dataclasses

from hf_dsinfer.injection.policies.deepseek_v3 import POLICY as DEEPSEEK_V3

POLICY = dataclasses.replace(
    DEEPSEEK_V3,
    family="glm4_moe_lite",
    model_types=("glm4_moe_lite",),
    block_classes=("Glm4MoeLiteDecoderLayer",),
    moe=dataclasses.replace(DEEPSEEK_V3.moe, classes=("Glm4MoeLiteMoE",)),
)
