"""BLOOM: ALiBi (the model passes `alibi` to each block), fused QKV per head ([q, k, v]:
GROUPED_GQA with a group per head)."""

from hf_dsinfer.injection.policy import ALIBI, GROUPED_GQA, SEQUENTIAL, FromConfig, Policy

POLICY = Policy(
    family="bloom",
    model_types=("bloom",),
    block_classes=("BloomBlock",),
    layers="transformer.h",
    layout=SEQUENTIAL,
    norm="layer",
    ln1="input_layernorm",
    ln2="post_attention_layernorm",
    attn="self_attention",
    qkv_layout=GROUPED_GQA,
    qkv=("query_key_value",),
    out_proj="dense",
    mlp="mlp",
    mlp_in=("dense_h_to_4h",),
    mlp_out="dense_4h_to_h",
    activation="bloom_gelu",
    positions=ALIBI,
    scale_attr="inv_norm_factor",
    residual_post_ln=FromConfig("apply_residual_connection_post_layernorm", None, False),
    cache_arg="layer_past",
    returns_tuple=True,
    tp_plan={"self_attention.query_key_value": "colwise", "self_attention.dense": "rowwise",
             "mlp.dense_h_to_4h": "colwise", "mlp.dense_4h_to_h": "rowwise"},
)
