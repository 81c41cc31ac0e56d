"""dots.llm1 (`dots1`): Qwen3's attention (per-head q / k RMSNorms before RoPE, sliding / full
`layer_types` through HF's masks) and, from layer `first_k_dense_replace` on, DeepSeek-V3's MoE
line for line (fp32 router GEMM, sigmoid scores, a correction bias steering the group-limited
top-k, renormalized weights times routed_scaling_factor, ungated shared experts). Tensor
parallelism slices attention, the dense MLPs and the shared experts Megatron-style and keeps
the routed experts whole (ep_size shards them), as for DeepSeek-V3."""

import dataclasses

from hf_dsinfer.injection.policies.deepseek_v3 import POLICY as DEEPSEEK_V3
from hf_dsinfer.injection.policies.llama import (
    ATTENTION_TP_PLAN,
    MLP_TP_PLAN,
    SHARED_EXPERTS_TP_PLAN,
)
from hf_dsinfer.injection.policies.qwen3 import POLICY as QWEN3

POLICY = dataclasses.replace(
    QWEN3,
    family="dots1",
    model_types=("dots1",),
    block_classes=("Dots1DecoderLayer",),
    tp_plan={**ATTENTION_TP_PLAN, **MLP_TP_PLAN, **SHARED_EXPERTS_TP_PLAN},
    moe=dataclasses.replace(DEEPSEEK_V3.moe, classes=("Dots1MoE",)),
)
