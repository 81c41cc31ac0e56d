"""Gemma (1): Llama's pre-norm block with Gemma's RMSNorm (`normalized * (1 + weight)` in fp32)
and a GeGLU MLP (config.hidden_act, tanh GELU). The embedding scale sqrt(hidden) is HF's
scaled-embedding module, outside the blocks."""

import dataclasses

from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import RMS_UNIT_OFFSET

POLICY = dataclasses.replace(
    LLAMA,
    family="gemma",
    model_types=("gemma",),
    block_classes=("GemmaDecoderLayer",),
    norm=RMS_UNIT_OFFSET,
)
