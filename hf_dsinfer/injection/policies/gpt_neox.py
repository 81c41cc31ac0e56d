"""GPT-NeoX / Pythia: partial rotary (rotary_pct), fused QKV per head ([q, k, v]:
GROUPED_GQA with a group per head), parallel or
sequential residual."""

from hf_dsinfer.injection.policy import (
    GROUPED_GQA,
    PARALLEL,
    ROPE,
    SEQUENTIAL,
    FromConfig,
    Policy,
)

POLICY = Policy(
    family="gpt_neox",
    model_types=("gpt_neox",),
    block_classes=("GPTNeoXLayer",),
    layers="gpt_neox.layers",
    layout=FromConfig("use_parallel_residual", {True: PARALLEL, False: SEQUENTIAL}, True),
    norm="layer",
    ln1="input_layernorm",
    ln2="post_attention_layernorm",
    attn="attention",
    qkv_layout=GROUPED_GQA,
    qkv=("query_key_value",),
    out_proj="dense",
    mlp="mlp",
    mlp_in=("dense_h_to_4h",),
    mlp_out="dense_4h_to_h",
    activation=FromConfig("hidden_act"),
    positions=ROPE,
    cache_arg="layer_past",
)
