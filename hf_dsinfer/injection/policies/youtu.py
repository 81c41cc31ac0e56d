"""Youtu-LLM (`youtu`): Llama's dense block with DeepSeek-V3's multi-head latent attention
(low-rank q and KV latent with their RMSNorms, one shared rotary key, interleaved RoPE per
config.rope_interleave; the HF cache holds the latent). Tensor parallelism splits MLA by heads
(as for DeepSeek-V3) and the MLP Megatron-style."""

import dataclasses

from hf_dsinfer.injection.policies.deepseek_v3 import POLICY as DEEPSEEK_V3
from hf_dsinfer.injection.policies.llama import MLP_TP_PLAN

POLICY = dataclasses.replace(
    DEEPSEEK_V3,
    family="youtu",
    model_types=("youtu",),
    block_classes=("YoutuDecoderLayer",),
    tp_plan={"self_attn.q_proj": "colwise", "self_attn.q_b_proj": "colwise",
             "self_attn.kv_b_proj": "colwise", "self_attn.o_proj": "rowwise", **MLP_TP_PLAN},
    moe=None,
)
