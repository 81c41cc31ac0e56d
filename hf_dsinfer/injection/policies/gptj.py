"""GPT-J: interleaved ("rotate every two") rotary on the first rotary_dim dims, from the sin|cos
table the attention module keeps; attention and MLP in parallel off one LayerNorm."""

from hf_dsinfer.injection.policy import (
    PARALLEL_SHARED_LN,
    ROPE_TABLE,
    SEPARATE,
    FromConfig,
    Policy,
)

POLICY = Policy(
    family="gptj",
    model_types=("gptj",),
    block_classes=("GPTJBlock",),
    layers="transformer.h",
    layout=PARALLEL_SHARED_LN,
    norm="layer",
    ln1="ln_1",
    ln2=None,
    attn="attn",
    qkv_layout=SEPARATE,
    qkv=("q_proj", "k_proj", "v_proj"),
    out_proj="out_proj",
    mlp="mlp",
    mlp_in=("fc_in",),
    mlp_out="fc_out",
    activation=FromConfig("activation_function"),
    positions=ROPE_TABLE,
    rotary_interleaved=True,
    scale_attr="scale_attn",
    scale_inverted=True,
    cache_arg="layer_past",
    returns_tuple=True,
    tp_plan={"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise",
             "attn.out_proj": "rowwise", "mlp.fc_in": "colwise", "mlp.fc_out": "rowwise"},
)
