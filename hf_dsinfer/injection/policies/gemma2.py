"""Gemma 2: sandwich norms (RMSNorm before and after attention and before and after the MLP, each
`normalized * (1 + weight)` in fp32), a GeGLU MLP (tanh GELU), softmax scale
query_pre_attn_scalar**-0.5 (read from the attention's `scaling`), a tanh soft-cap of the
attention logits, and sliding / global layers alternating (`layer_types`, through HF's masks
per layer). The embedding scale sqrt(hidden) and the final logit soft-cap are HF's model-level
code around the blocks and run unchanged. HF's base_model_tp_plan is Megatron's."""

import dataclasses

from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import RMS_UNIT_OFFSET, SANDWICH, FromConfig

POLICY = dataclasses.replace(
    LLAMA,
    family="gemma2",
    model_types=("gemma2",),
    block_classes=("Gemma2DecoderLayer",),
    layout=SANDWICH,
    norm=RMS_UNIT_OFFSET,
    ln2="pre_feedforward_layernorm",
    post_attn_norm="post_attention_layernorm",
    post_mlp_norm="post_feedforward_layernorm",
    activation=FromConfig("hidden_activation"),
    softcap_attr="attn_logit_softcapping",
)
