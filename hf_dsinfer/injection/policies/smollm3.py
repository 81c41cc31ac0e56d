"""SmolLM3: Llama's block where every `no_rope_layer_interval`-th layer is a NoPE layer (its
attention's `use_rope` is false: q and k are not rotated); optional sliding window on the
NoPE layers via HF's per-layer masks."""

import dataclasses

from hf_dsinfer.injection.policies.llama import POLICY as LLAMA

POLICY = dataclasses.replace(
    LLAMA,
    family="smollm3",
    model_types=("smollm3",),
    block_classes=("SmolLM3DecoderLayer",),
    rope_attr="use_rope",
)
