"""Granite MoE with a shared MLP (`granitemoeshared`) and Granite MoE SWA (`granitemoe_swa`):
Granite MoE's policy plus the MLP HF adds to the MoE's output (`shared_mlp`: input_linear ->
[gate | up] -> SiLU-gated -> output_linear; none where shared_intermediate_size is 0), run as
its own module (`moe_shared_mlp`), its linears quantized with the block's and whole on every
tensor-parallel rank. Granite MoE SWA adds Granite SWA's attention: a learned sink logit per
head, sliding / full `layer_types` and a RoPE base per layer whose 0 makes a NoPE layer."""

import dataclasses

from hf_dsinfer.injection.policies.granitemoe import POLICY as GRANITEMOE
from hf_dsinfer.injection.policy import MoeLayout

POLICY = dataclasses.replace(
    GRANITEMOE,
    family="granitemoeshared",
    model_types=("granitemoeshared",),
    block_classes=("GraniteMoeSharedDecoderLayer",),
    moe=dataclasses.replace(GRANITEMOE.moe, classes=("GraniteMoeSharedMoE",)),
    moe_shared_mlp="shared_mlp",
)

POLICY_SWA = dataclasses.replace(
    POLICY,
    family="granitemoe_swa",
    model_types=("granitemoe_swa",),
    block_classes=("GraniteMoeSWADecoderLayer",),
    moe=MoeLayout(classes=("GraniteMoeSWAMoE",), num_experts="num_local_experts",
                  router="router", renormalize=False, softmax_first=False),
    sinks_attr="sinks",
    rope_optional=True,
)
