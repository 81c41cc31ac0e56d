"""OPT: pre-LN, and the post-LN 350m variant (do_layer_norm_before=False; its
project_in/project_out live outside the blocks and stay HF modules)."""

from hf_dsinfer.injection.policy import POST_LN, SEPARATE, SEQUENTIAL, FromConfig, Policy

POLICY = Policy(
    family="opt",
    model_types=("opt",),
    block_classes=("OPTDecoderLayer",),
    layers="model.decoder.layers",
    layout=FromConfig("do_layer_norm_before", {True: SEQUENTIAL, False: POST_LN}, True),
    norm="layer",
    ln1="self_attn_layer_norm",
    ln2="final_layer_norm",
    attn="self_attn",
    qkv_layout=SEPARATE,
    qkv=("q_proj", "k_proj", "v_proj"),
    out_proj="out_proj",
    mlp="",
    mlp_in=("fc1",),
    mlp_out="fc2",
    activation=FromConfig("activation_function"),
    scale_query=True,
    tp_plan={"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
             "self_attn.v_proj": "colwise", "self_attn.out_proj": "rowwise", "fc1": "colwise",
             "fc2": "rowwise"},
)
