"""Granite: Llama's block with the softmax scale set to `attention_multiplier` (read from the
attention's `scaling`) and both branch outputs scaled by `residual_multiplier` before the
residual add. The embedding multiplier and the logits' division by `logits_scaling` are HF's
model-level code around the blocks and run unchanged."""

import dataclasses

from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import FromConfig

POLICY = dataclasses.replace(
    LLAMA,
    family="granite",
    model_types=("granite",),
    block_classes=("GraniteDecoderLayer",),
    residual_multiplier=FromConfig("residual_multiplier"),
)
