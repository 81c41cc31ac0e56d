"""OLMo 2: Llama's attention and MLP with RMSNorm over the whole q and k projections (before
the head split, as OLMoE) and norms only *after* attention and MLP, before each residual add
(no pre-norms). Its RMSNorm multiplies by the weight in fp32 before rounding, and its cos / sin
stay fp32 (q and k rotate in fp32). OLMo 3 is the same block with sliding / global
`layer_types` (HF's per-layer masks) and a RoPE base per layer type (HF's per-layer cos / sin)."""

import dataclasses

from hf_dsinfer.injection.policies.llama import ATTENTION_TP_PLAN, MLP_TP_PLAN
from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import QK_NORM_FULL, RMS_FP32, SANDWICH

POLICY = dataclasses.replace(
    LLAMA,
    family="olmo2",
    model_types=("olmo2", "olmo3"),
    block_classes=("Olmo2DecoderLayer", "Olmo3DecoderLayer"),
    layout=SANDWICH,
    norm=RMS_FP32,
    ln1=None,
    ln2=None,
    post_attn_norm="post_attention_layernorm",
    post_mlp_norm="post_feedforward_layernorm",
    qk_norm=QK_NORM_FULL,
    # HF's base_model_tp_plan gathers q/k/v back to full width for the q/k norm; ours slices
    # attention by heads with the norm weights and all-reduces the sum of squares, as OLMoE.
    tp_plan={**ATTENTION_TP_PLAN, **MLP_TP_PLAN},
)
