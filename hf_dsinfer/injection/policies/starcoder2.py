"""StarCoder2 (`starcoder2`): Llama's attention (GQA, RoPE, a sliding window through HF's masks)
with nn.LayerNorm pre-norms and a plain MLP `c_fc` -> activation (tanh GELU) -> `c_proj`; every
projection may carry a bias (`use_bias`). HF's base_model_tp_plan splits it Megatron-style."""

import dataclasses

from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import LAYER

POLICY = dataclasses.replace(
    LLAMA,
    family="starcoder2",
    model_types=("starcoder2",),
    block_classes=("Starcoder2DecoderLayer",),
    norm=LAYER,
    mlp_in=("c_fc",),
    mlp_out="c_proj",
    gated=False,
    notes="",
)
