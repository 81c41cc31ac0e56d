"""GLM-4 (`glm4`, GLM-4-0414): GLM's block (fused `gate_up_proj`, partial RoPE over interleaved
pairs) with sandwich norms: `post_self_attn_layernorm` after attention, `post_attention_layernorm`
before the MLP (HF's name) and `post_mlp_layernorm` after it. Torch ops at batch-1 decode, as
GLM."""

import dataclasses

from hf_dsinfer.injection.policies.glm import POLICY as GLM
from hf_dsinfer.injection.policy import SANDWICH

POLICY = dataclasses.replace(
    GLM,
    family="glm4",
    model_types=("glm4",),
    block_classes=("Glm4DecoderLayer",),
    layout=SANDWICH,
    post_attn_norm="post_self_attn_layernorm",
    post_mlp_norm="post_mlp_layernorm",
)
