"""MiniCPM3 (`minicpm3`): Youtu-LLM's block (DeepSeek's multi-head latent attention on dense
Llama blocks; MiniCPM3's RoPE rotates half of the rotary dims against the other half, not
interleaved pairs) with both branch outputs times the layer's `residual_scale`
(scale_depth / sqrt(num_hidden_layers), read from each block) before the residual add. The
embedding scale (`scale_emb`) and the logits' division by hidden_size / dim_model_base are HF's
model-level code around the blocks and run unchanged."""

import dataclasses

from hf_dsinfer.injection.policies.youtu import POLICY as YOUTU
from hf_dsinfer.injection.policy import FromBlock

POLICY = dataclasses.replace(
    YOUTU,
    family="minicpm3",
    model_types=("minicpm3",),
    block_classes=("MiniCPM3DecoderLayer",),
    residual_multiplier=FromBlock("residual_scale"),
)
