"""Solar Open (`solar_open`): Llama's attention (no q / k norms, full rotary) with GLM-4.5's MoE
on every layer: DeepSeek-V3's routing line for line (sigmoid scores, a correction bias steering
the choice, group-limited top-k, renormalized weights times routed_scaling_factor, fp32 router
GEMM) plus ungated shared experts. Tensor parallelism slices attention and the shared experts
Megatron-style and keeps the routed experts whole (ep_size shards them)."""

import dataclasses

from hf_dsinfer.injection.policies.glm4_moe import POLICY as GLM4_MOE

POLICY = dataclasses.replace(
    GLM4_MOE,
    family="solar_open",
    model_types=("solar_open",),
    block_classes=("SolarOpenDecoderLayer",),
    qk_norm=None,
    moe=dataclasses.replace(GLM4_MOE.moe, classes=("SolarOpenMoE",)),
)
