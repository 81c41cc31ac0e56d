"""Granite MoE (`granitemoe`: Granite 3.0 / 3.1 1B-A400M and 3B-A800M): Granite's block
(attention_multiplier as the softmax scale, both branch outputs times residual_multiplier) with
a sparse MoE in every layer (`block_sparse_moe`): the router's logits (a bf16 GEMM, then fp32),
top-k of them, a softmax over those k, weights cast to the activations' dtype; experts in
transformers' canonical [gate | up] form. The embedding multiplier and the logits' division
are HF's model code. Tensor parallelism slices attention; ep_size shards the experts."""

import dataclasses

from hf_dsinfer.injection.policies.granite import POLICY as GRANITE
from hf_dsinfer.injection.policies.llama import ATTENTION_TP_PLAN
from hf_dsinfer.injection.policy import MoeLayout

POLICY = dataclasses.replace(
    GRANITE,
    family="granitemoe",
    model_types=("granitemoe",),
    block_classes=("GraniteMoeDecoderLayer",),
    mlp="block_sparse_moe",
    mlp_in=(),
    mlp_out="",
    tp_plan=ATTENTION_TP_PLAN,
    moe=MoeLayout(classes=("GraniteMoeMoE",), num_experts="num_local_experts", router="router",
                  renormalize=False, softmax_first=False),
)
