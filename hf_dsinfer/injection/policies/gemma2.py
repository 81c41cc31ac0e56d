"""Gemma 2: sandwich norms (RMSNorm before and after attention and before and after the MLP, each
`normalized * (1 + weight)` in fp32), a GeGLU MLP (tanh GELU), softmax scale
query_pre_attn_scalar**-0.5 (read from the attention's `scaling`), a tanh soft-cap of the
attention logits, and sliding / global layers alternating (`layer_types`, through HF's masks
per layer). The embedding scale sqrt(hidden) and the final logit soft-cap are HF's model-level
code around the blocks and run unchanged. HF's base_model_tp_plan is Megatron's."""

from hf_dsinfer.injection.policy import (
    RMS_UNIT_OFFSET,
    ROPE,
    SANDWICH,
    SEPARATE,
    FromConfig,
    Policy,
)

POLICY = Policy(
    family="gemma2",
    model_types=("gemma2",),
    block_classes=("Gemma2DecoderLayer",),
    layers="model.layers",
    layout=SANDWICH,
    norm=RMS_UNIT_OFFSET,
    ln1="input_layernorm",
    ln2="pre_feedforward_layernorm",
    post_attn_norm="post_attention_layernorm",
    post_mlp_norm="post_feedforward_layernorm",
    attn="self_attn",
    qkv_layout=SEPARATE,
    qkv=("q_proj", "k_proj", "v_proj"),
    out_proj="o_proj",
    mlp="mlp",
    mlp_in=("gate_proj", "up_proj"),
    mlp_out="down_proj",
    gated=True,
    activation=FromConfig("hidden_activation"),
    positions=ROPE,
    softcap_attr="attn_logit_softcapping",
)
