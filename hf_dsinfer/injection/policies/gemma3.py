"""Gemma 3 (text): Gemma 2's block (the attention soft-cap only where the config sets one) plus
per-head q/k RMSNorm (Gemma's (1 + weight) numerics) before RoPE; `layer_types` 5:1
sliding / global, each layer type with its own RoPE base (HF computes cos / sin per layer type
and passes each block its own). HF's base_model_tp_plan is Megatron's (q/k norm weights
[head_dim] replicated)."""

import dataclasses

from hf_dsinfer.injection.policies.gemma2 import POLICY as GEMMA2
from hf_dsinfer.injection.policy import QK_NORM_HEAD

POLICY = dataclasses.replace(
    GEMMA2,
    family="gemma3_text",
    model_types=("gemma3_text",),
    block_classes=("Gemma3DecoderLayer",),
    qk_norm=QK_NORM_HEAD,
)
