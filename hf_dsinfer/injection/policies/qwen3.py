"""Qwen3 (dense): Llama's block plus per-head RMSNorm of q and k (over head_dim, before RoPE);
head_dim is its own config value (not hidden / heads). Sliding window via HF's per-layer masks.
HF's base_model_tp_plan slices attention and MLP Megatron-style (the q/k norm weights
[head_dim] are replicated)."""

import dataclasses

from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import QK_NORM_HEAD

POLICY = dataclasses.replace(
    LLAMA,
    family="qwen3",
    model_types=("qwen3",),
    block_classes=("Qwen3DecoderLayer",),
    qk_norm=QK_NORM_HEAD,
)
