"""K-EXAONE (`exaone_moe`): EXAONE 4's attention (per-head q / k RMSNorms before RoPE; the
attention names `sliding_window` on every layer and slides where `is_sliding`; with a window
configured the full layers are NoPE) in a pre-norm block (OLMoE's: input and post-attention
norms), and on the layers `mlp_layer_types` calls sparse DeepSeek-V3's MoE line for line
(sigmoid scores, a correction bias steering the choice, group-limited top-k, renormalized
weights times routed_scaling_factor, fp32 router GEMM, ungated shared experts); the others are
dense gated MLPs. Tensor parallelism slices attention, the dense MLPs and the shared experts
Megatron-style and keeps the routed experts whole (ep_size shards them)."""

import dataclasses

from hf_dsinfer.injection.policies.deepseek_v3 import POLICY as DEEPSEEK_V3
from hf_dsinfer.injection.policies.exaone4 import POLICY as EXAONE4
from hf_dsinfer.injection.policies.llama import (
    ATTENTION_TP_PLAN,
    MLP_TP_PLAN,
    SHARED_EXPERTS_TP_PLAN,
)
from hf_dsinfer.injection.policy import SEQUENTIAL

POLICY = dataclasses.replace(
    EXAONE4,
    family="exaone_moe",
    model_types=("exaone_moe",),
    block_classes=("ExaoneMoeDecoderLayer",),
    layout=SEQUENTIAL,
    ln1="input_layernorm",
    ln2="post_attention_layernorm",
    post_attn_norm=None,
    post_mlp_norm=None,
    tp_plan={**ATTENTION_TP_PLAN, **MLP_TP_PLAN, **SHARED_EXPERTS_TP_PLAN},
    moe=dataclasses.replace(DEEPSEEK_V3.moe, classes=("ExaoneMoeSparseMoEBlock",),
                            num_experts="num_experts"),
)
