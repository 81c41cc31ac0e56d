"""EXAONE 4.0: OLMo 2's layout (norms only after attention and MLP, before each residual add)
with Llama's RMSNorm, per-head q / k RMSNorms before RoPE (Qwen3's), and sliding / global
`layer_types`. Its attention keeps `sliding_window` on every layer and slides where
`is_sliding` (HF's per-layer masks say the same: `sliding_attr`); with a window configured the
global layers rotate nothing (NoPE, `rope_sliding_only`), without one every layer rotates.
HF's base_model_tp_plan slices attention and MLP Megatron-style (q / k norm weights
replicated)."""

import dataclasses

from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import QK_NORM_HEAD, SANDWICH

POLICY = dataclasses.replace(
    LLAMA,
    family="exaone4",
    model_types=("exaone4",),
    block_classes=("Exaone4DecoderLayer",),
    layout=SANDWICH,
    ln1=None,
    ln2=None,
    post_attn_norm="post_attention_layernorm",
    post_mlp_norm="post_feedforward_layernorm",
    qk_norm=QK_NORM_HEAD,
    sliding_attr="is_sliding",
    rope_sliding_only=True,
)
