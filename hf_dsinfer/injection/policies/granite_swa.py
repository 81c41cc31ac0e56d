"""Granite SWA: Granite's block (residual multiplier, attention multiplier as the softmax scale)
with sliding / full `layer_types` (HF's masks per layer), a learned attention-sink logit per
head (gpt-oss's `sinks`), and a RoPE base per layer (`layer_rope_theta`) whose 0 makes a NoPE
layer: the model computes cos / sin per base and passes None to those layers
(`rope_optional`). The native C layer has no sinks: torch ops at batch-1 decode, and explain
names the reason."""

import dataclasses

from hf_dsinfer.injection.policies.granite import POLICY as GRANITE

POLICY = dataclasses.replace(
    GRANITE,
    family="granite_swa",
    model_types=("granite_swa",),
    block_classes=("GraniteSWADecoderLayer",),
    sinks_attr="sinks",
    rope_optional=True,
)
