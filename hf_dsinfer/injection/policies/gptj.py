"""GPT-J: interleaved ("rotate every two") rotary on the first rotary_dim dims; attention and MLP
in parallel off one LayerNorm.

transformers 5.24 rewrote GPT-J's modeling in Llama's mould: the model's rotary module gathers
(sin, cos) once and hands them to every block as `position_embeddings`, the attention keeps its
softmax scale as `scaling` (head_dim ** -0.5), and a block takes `cache` and returns the hidden
states alone. Before, each attention module kept the [max_pos, rotary_dim] sin|cos table
(`embed_positions`, gathered by position_ids) and `scale_attn` (sqrt(head_dim)), and a block took
`layer_past` and returned a tuple. The policy describes the installed release's blocks; the
fused block reads the sin / cos from whichever source the block has (fused._gptj_cos_sin)."""

import inspect

from transformers.models.gptj.modeling_gptj import GPTJBlock

from hf_dsinfer.injection.policy import (
    PARALLEL_SHARED_LN,
    ROPE_TABLE,
    SEPARATE,
    FromConfig,
    Policy,
)

_GATHERED = "position_embeddings" in inspect.signature(GPTJBlock.forward).parameters  # >= 5.24

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
    scale_attr="scaling" if _GATHERED else "scale_attn",
    scale_inverted=not _GATHERED,
    cache_arg="cache" if _GATHERED else "layer_past",
    returns_tuple=not _GATHERED,
    tp_plan={"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise",
             "attn.out_proj": "rowwise", "mlp.fc_in": "colwise", "mlp.fc_out": "rowwise"},
)
