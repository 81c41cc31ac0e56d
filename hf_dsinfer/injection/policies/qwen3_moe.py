"""Qwen3-MoE: attention with per-head RMSNorm of q and k (over head_dim, before RoPE) and a sparse
MoE MLP (no shared expert); dense layers per `mlp_only_layers` / `decoder_sparse_step`."""

from hf_dsinfer.injection.policy import (
    QK_NORM_HEAD,
    ROPE,
    SEPARATE,
    SEQUENTIAL,
    FromConfig,
    MoeLayout,
    Policy,
)

POLICY = Policy(
    family="qwen3_moe",
    model_types=("qwen3_moe",),
    block_classes=("Qwen3MoeDecoderLayer",),
    layers="model.layers",
    layout=SEQUENTIAL,
    norm="rms",
    ln1="input_layernorm",
    ln2="post_attention_layernorm",
    attn="self_attn",
    qkv_layout=SEPARATE,
    qkv=("q_proj", "k_proj", "v_proj"),
    out_proj="o_proj",
    mlp="mlp",
    mlp_in=("gate_proj", "up_proj"),  # dense layers
    mlp_out="down_proj",
    gated=True,
    activation=FromConfig("hidden_act"),
    positions=ROPE,
    qk_norm=QK_NORM_HEAD,
    moe=MoeLayout(classes=("Qwen3MoeSparseMoeBlock",), num_experts="num_experts",
                  renormalize=FromConfig("norm_topk_prob")),
)
