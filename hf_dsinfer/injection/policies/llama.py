"""Llama family: Llama, Mistral, Qwen2 (GQA, optional attention bias, any HF rope_scaling,
sliding window via the masks HF builds per layer)."""

from hf_dsinfer.injection.policy import ROPE, SEPARATE, SEQUENTIAL, FromConfig, Policy

POLICY = Policy(
    family="llama",
    model_types=("llama", "mistral", "qwen2"),
    block_classes=("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"),
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
    mlp_in=("gate_proj", "up_proj"),
    mlp_out="down_proj",
    gated=True,
    activation=FromConfig("hidden_act"),
    positions=ROPE,
    notes="cos/sin come from the model's own rotary_emb, so every HF rope_scaling type works",
)
