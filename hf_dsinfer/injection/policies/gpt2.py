"""GPT-2: transformers' Conv1D weights ([in, out]), packed [q | k | v] c_attn, learned
positions, pre-LN."""

from hf_dsinfer.injection.policy import PACKED, SEQUENTIAL, FromConfig, Policy

POLICY = Policy(
    family="gpt2",
    model_types=("gpt2",),
    block_classes=("GPT2Block",),
    layers="transformer.h",
    layout=SEQUENTIAL,
    norm="layer",
    ln1="ln_1",
    ln2="ln_2",
    attn="attn",
    qkv_layout=PACKED,
    qkv=("c_attn",),
    out_proj="c_proj",
    mlp="mlp",
    mlp_in=("c_fc",),
    mlp_out="c_proj",
    activation=FromConfig("activation_function"),
    conv1d=True,
    tp_plan={"attn.c_attn": "colwise", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise",
             "mlp.c_proj": "rowwise"},
    notes="scale_attn_by_inverse_layer_idx is read per layer from the attention's `scaling`",
)
