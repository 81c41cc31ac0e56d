"""Llama family: Llama, Mistral, Qwen2 (GQA, optional attention bias, any HF rope_scaling,
sliding window via the masks HF builds per layer), and the families that are these blocks under
another name: Ministral (Qwen2's block without biases, sliding / full `layer_types`), Seed-OSS
(biases on q / k / v and, apart, on o_proj and the MLP), InternLM3 (HF runs it as Llama) and
Meta's Code World Model (`cwm`: Qwen2's attention without biases, sliding / full `layer_types`
3:1, llama3 RoPE scaling)."""

from hf_dsinfer.injection.policy import ROPE, SEPARATE, SEQUENTIAL, FromConfig, Policy

POLICY = Policy(
    family="llama",
    model_types=("llama", "mistral", "qwen2", "ministral", "seed_oss", "internlm3",
                 "cwm"),
    block_classes=("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer",
                   "MinistralDecoderLayer", "SeedOssDecoderLayer", "CwmDecoderLayer"),
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

# Megatron splits of this block's linears, for families derived from it whose HF
# base_model_tp_plan does not fit (the mixture-of-experts families: it slices their experts).
ATTENTION_TP_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
                     "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise"}
MLP_TP_PLAN = {"mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}
# the same split of a MoE layer's ungated shared experts (DeepSeek-V3, GLM-4.5, ERNIE 4.5 MoE)
SHARED_EXPERTS_TP_PLAN = {"mlp.shared_experts.gate_proj": "colwise",
                          "mlp.shared_experts.up_proj": "colwise",
                          "mlp.shared_experts.down_proj": "rowwise"}
