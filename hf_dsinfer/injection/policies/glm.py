"""GLM (GLM-4-9B, `glm`): Llama's block with Phi-3's fused `gate_up_proj`, biases on q / k / v
(`attention_bias`) but none on o_proj, and partial RoPE (`partial_rotary_factor`) over
interleaved pairs read from Llama's cos / sin tables (`rope_pairs_table`), which the native
decode layer rotates too (ROPE_BF16_PAIRS over the first rotary_dim dims of each head)."""

import dataclasses

from hf_dsinfer.injection.policies.llama import ATTENTION_TP_PLAN
from hf_dsinfer.injection.policies.llama import POLICY as LLAMA

POLICY = dataclasses.replace(
    LLAMA,
    family="glm",
    model_types=("glm",),
    block_classes=("GlmDecoderLayer",),
    mlp_in=("gate_up_proj",),
    rotary_interleaved=True,
    rope_pairs_table=True,
    tp_plan={**ATTENTION_TP_PLAN, "mlp.gate_up_proj": "colwise", "mlp.down_proj": "rowwise"},
    notes="",
)
