"""Jais 2 (`jais2`): Llama's attention (q / k / v / o biases with `attention_bias`) with
nn.LayerNorm pre-norms and a plain MLP `up_proj` -> squared ReLU -> `down_proj` (Nemotron's,
biased with `mlp_bias`). HF's base_model_tp_plan splits it Megatron-style."""

import dataclasses

from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import LAYER

POLICY = dataclasses.replace(
    LLAMA,
    family="jais2",
    model_types=("jais2",),
    block_classes=("Jais2DecoderLayer",),
    norm=LAYER,
    mlp_in=("up_proj",),
    gated=False,
    notes="",
)
