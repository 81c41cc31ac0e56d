"""Qwen2-MoE: Qwen2 attention (q/k/v bias) and, on every `decoder_sparse_step`-th layer not in
`mlp_only_layers`, a sparse MoE (top-k of the fp32 softmax, renormalized when norm_topk_prob,
weights cast to the logits' dtype) plus a shared expert scaled by sigmoid(shared_expert_gate(x));
the other layers have a dense gated MLP."""

from hf_dsinfer.injection.policy import ROPE, SEPARATE, SEQUENTIAL, FromConfig, MoeLayout, Policy

POLICY = Policy(
    family="qwen2_moe",
    model_types=("qwen2_moe",),
    block_classes=("Qwen2MoeDecoderLayer",),
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
    mlp_in=("gate_proj", "up_proj"),  # dense layers and the shared expert
    mlp_out="down_proj",
    gated=True,
    activation=FromConfig("hidden_act"),
    positions=ROPE,
    moe=MoeLayout(classes=("Qwen2MoeSparseMoeBlock",), num_experts="num_experts",
                  renormalize=FromConfig("norm_topk_prob"), shared_expert="shared_expert",
                  shared_expert_gate="shared_expert_gate"),
)
