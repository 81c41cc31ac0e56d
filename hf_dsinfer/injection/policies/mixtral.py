"""Mixtral: Llama-style attention (GQA, sliding window via HF's masks) and a sparse MoE MLP:
softmax in fp32 over all experts, top-k, renormalized, routing weights kept in fp32."""

from hf_dsinfer.injection.policy import ROPE, SEPARATE, SEQUENTIAL, FromConfig, MoeLayout, Policy

POLICY = Policy(
    family="mixtral",
    model_types=("mixtral",),
    block_classes=("MixtralDecoderLayer",),
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
    moe=MoeLayout(classes=("MixtralSparseMoeBlock",), num_experts="num_local_experts",
                  renormalize=True, fp32_weights=True),
)
