"""Nemotron (`nemotron`: Nemotron-4 / Minitron): Llama's attention with partial rotary
(rotate-half over the first partial_rotary_factor of each head), LayerNorm1P pre-norms
(nn.LayerNorm with its weight read as 1 + w, `LAYER_1P`) and a plain MLP `up_proj` -> squared
ReLU -> `down_proj`; biases where the config asks for them."""

import dataclasses

from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import LAYER_1P

POLICY = dataclasses.replace(
    LLAMA,
    family="nemotron",
    model_types=("nemotron",),
    block_classes=("NemotronDecoderLayer",),
    norm=LAYER_1P,
    mlp_in=("up_proj",),
    gated=False,
    notes="",
)
