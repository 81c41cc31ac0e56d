"""Falcon (`falcon`: Falcon-7B / 40B / 180B, Falcon2-11B): LayerNorms, RoPE, a GELU MLP
(`dense_h_to_4h` -> GELU -> `dense_4h_to_h`) and one `query_key_value` projection packed per KV
head as [q x (heads / KV heads), k, v] (`GROUPED_GQA`): one group with `multi_query` (7B), a
group per head without it, `num_kv_heads` groups in the new decoder architecture (40B / 180B /
11B).

Three config flags wire the block (read from transformers' FalconDecoderLayer):
- parallel_attn, old architecture: attention and MLP off one `input_layernorm` (7B);
- new architecture with two norms (`num_ln_in_parallel_attn` 2, the default transformers sets
  when it builds the layers): `ln_attn` before the attention, `ln_mlp` before the MLP (40B);
  with one (11B), `input_layernorm` for both;
- parallel_attn off: a sequential block, `input_layernorm` then `post_attention_layernorm`.
The other combinations fail in transformers' own forward, and the policy maps none of them.

ALiBi configs (Falcon-RW) are refused: transformers' eager path adds the bias to the scores and
again through the mask it built, its SDPA path once; neither is a reference to match."""

from hf_dsinfer.injection.policy import (
    GROUPED_GQA,
    PARALLEL,
    PARALLEL_SHARED_LN,
    ROPE,
    SEQUENTIAL,
    FromConfig,
    Policy,
)

_FLAGS = ("parallel_attn", "new_decoder_architecture", "num_ln_in_parallel_attn")
_SHARED = (PARALLEL_SHARED_LN, "input_layernorm", None)
_TWO = (PARALLEL, "ln_attn", "ln_mlp")
_SEQUENTIAL = (SEQUENTIAL, "input_layernorm", "post_attention_layernorm")
_WIRING = {  # (parallel_attn, new_decoder_architecture, num_ln_in_parallel_attn) -> wiring
    (True, True, 2): _TWO, (True, True, None): _TWO, (True, True, 1): _SHARED,
    (True, False, None): _SHARED, (True, False, 1): _SHARED,
    **{(False, False, n): _SEQUENTIAL for n in (None, 1, 2)},
}


def _wiring(part: int) -> FromConfig:
    return FromConfig(_FLAGS, {flags: wiring[part] for flags, wiring in _WIRING.items()})


POLICY = Policy(
    family="falcon",
    model_types=("falcon",),
    block_classes=("FalconDecoderLayer",),
    layers="transformer.h",
    layout=_wiring(0),
    norm="layer",
    ln1=_wiring(1),
    ln2=_wiring(2),
    attn="self_attention",
    qkv_layout=GROUPED_GQA,
    qkv=("query_key_value",),
    out_proj="dense",
    mlp="mlp",
    mlp_in=("dense_h_to_4h",),
    mlp_out="dense_4h_to_h",
    activation=FromConfig("activation"),
    positions=ROPE,
    scale_attr="inv_norm_factor",
    cache_arg="layer_past",
    returns_tuple=True,
    tp_plan={"self_attention.query_key_value": "colwise", "self_attention.dense": "rowwise",
             "mlp.dense_h_to_4h": "colwise", "mlp.dense_4h_to_h": "rowwise"},
    unsupported_when=(("alibi", True,
                       ("ALiBi positions as Falcon-RW adds them (transformers' eager attention "
                        "adds the bias twice, its SDPA attention once)")),),
)
