"""Arcee AFM (`arcee`): Llama's block with a plain MLP `up_proj` -> squared ReLU ->
`down_proj` in place of SwiGLU (and YaRN from the model's own rotary_emb)."""

import dataclasses

from hf_dsinfer.injection.policies.llama import POLICY as LLAMA

POLICY = dataclasses.replace(
    LLAMA,
    family="arcee",
    model_types=("arcee",),
    block_classes=("ArceeDecoderLayer",),
    mlp_in=("up_proj",),
    gated=False,
    notes="",
)
