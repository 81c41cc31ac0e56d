"""OLMo (`olmo`, the first OLMo 1B / 7B releases): Llama's block with OLMo's LayerNorms, which
have no weight or bias and normalize in fp32 with a hard-coded epsilon of 1e-5 (`LAYER_PLAIN`,
`norm_eps`), and q, k, v clamped to +-clip_qkv where the config sets it (OLMoE's option)."""

import dataclasses

from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import LAYER_PLAIN, FromConfig

POLICY = dataclasses.replace(
    LLAMA,
    family="olmo",
    model_types=("olmo",),
    block_classes=("OlmoDecoderLayer",),
    norm=LAYER_PLAIN,
    norm_eps=1e-5,
    clip_qkv=FromConfig("clip_qkv"),
    notes="",
)
