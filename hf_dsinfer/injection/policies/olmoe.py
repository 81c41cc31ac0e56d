"""OLMoE: RMSNorm over the whole q and k projections (not per head) before the head split, an
optional clamp of q/k/v to +-clip_qkv, and a sparse MoE MLP in every layer."""

from hf_dsinfer.injection.policy import (
    QK_NORM_FULL,
    ROPE,
    SEPARATE,
    SEQUENTIAL,
    FromConfig,
    MoeLayout,
    Policy,
)

POLICY = Policy(
    family="olmoe",
    model_types=("olmoe",),
    block_classes=("OlmoeDecoderLayer",),
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
    mlp_in=(),
    mlp_out="",
    gated=True,
    activation=FromConfig("hidden_act"),
    positions=ROPE,
    qk_norm=QK_NORM_FULL,
    clip_qkv=FromConfig("clip_qkv"),
    moe=MoeLayout(classes=("OlmoeSparseMoeBlock",), num_experts="num_experts",
                  renormalize=FromConfig("norm_topk_prob")),
)
