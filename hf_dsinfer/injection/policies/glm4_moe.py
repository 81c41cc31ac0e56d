"""GLM-4.5 / GLM-4.6 (`glm4_moe`): Llama's attention with q / k / v biases (`attention_bias`),
partial rotary (rotate-half over `partial_rotary_factor` of each head) and, where the config
says `use_qk_norm`, per-head q / k RMSNorms before RoPE (Qwen3's, resolved per config); from
layer `first_k_dense_replace` on, DeepSeek-V3's MoE line for line (sigmoid scores, a correction
bias steering the choice, group-limited top-k, renormalized weights times routed_scaling_factor,
fp32 router GEMM, ungated shared experts). Tensor parallelism slices attention, the dense MLPs
and the shared experts Megatron-style and keeps the routed experts whole (ep_size shards
them), as for DeepSeek-V3."""

import dataclasses

from hf_dsinfer.injection.policies.deepseek_v3 import POLICY as DEEPSEEK_V3
from hf_dsinfer.injection.policies.llama import (
    ATTENTION_TP_PLAN,
    MLP_TP_PLAN,
    SHARED_EXPERTS_TP_PLAN,
)
from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import QK_NORM_HEAD, FromConfig

POLICY = dataclasses.replace(
    LLAMA,
    family="glm4_moe",
    model_types=("glm4_moe",),
    block_classes=("Glm4MoeDecoderLayer",),
    qk_norm=FromConfig("use_qk_norm", {True: QK_NORM_HEAD, False: None}, default=False),
    tp_plan={**ATTENTION_TP_PLAN, **MLP_TP_PLAN, **SHARED_EXPERTS_TP_PLAN},
    moe=dataclasses.replace(DEEPSEEK_V3.moe, classes=("Glm4MoeMoE",)),
)
