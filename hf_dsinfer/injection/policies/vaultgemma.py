"""VaultGemma: Gemma 2's block without its two post-norms, so pre-norms only (`input_layernorm`
before attention, `pre_feedforward_layernorm` before the MLP), each `normalized * (1 + weight)`
in fp32; Gemma 2's attention (query_pre_attn_scalar, tanh soft-cap of the logits, sliding /
global `layer_types` through HF's masks) and GeGLU MLP. The embedding scale and the final logit
soft-cap are HF's model-level code and run unchanged."""

import dataclasses

from hf_dsinfer.injection.policies.gemma2 import POLICY as GEMMA2
from hf_dsinfer.injection.policy import SEQUENTIAL

POLICY = dataclasses.replace(
    GEMMA2,
    family="vaultgemma",
    model_types=("vaultgemma",),
    block_classes=("VaultGemmaDecoderLayer",),
    layout=SEQUENTIAL,
    post_attn_norm=None,
    post_mlp_norm=None,
)
