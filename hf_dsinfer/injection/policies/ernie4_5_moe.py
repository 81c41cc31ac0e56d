"""ERNIE 4.5 MoE (ERNIE-4.5-21B-A3B, -300B-A47B; `ernie4_5_moe`): ERNIE 4.5's attention (RoPE
over interleaved pairs from Llama's tables, rotated in fp32; biases per `use_bias`) and, on the
layers `moe_layer_start_index`..`moe_layer_end_index` every `moe_layer_interval`, a sparse MoE:
fp32 router GEMM and softmax, the experts chosen by the probabilities plus a correction bias
(`gate.moe_statics.e_score_correction_bias`), their plain probabilities renormalized by
max(sum, `moe_norm_min`) and cast to the activations' dtype (`scoring="softmax_biased"`), plus
ungated shared experts. Other layers are dense gated MLPs (Llama's names). Tensor parallelism
slices attention, the dense MLPs and the shared experts Megatron-style and keeps the routed
experts whole (ep_size shards them)."""

import dataclasses

from hf_dsinfer.injection.policies.ernie4_5 import POLICY as ERNIE
from hf_dsinfer.injection.policies.llama import (
    ATTENTION_TP_PLAN,
    MLP_TP_PLAN,
    SHARED_EXPERTS_TP_PLAN,
)
from hf_dsinfer.injection.policy import FromConfig, MoeLayout

POLICY = dataclasses.replace(
    ERNIE,
    family="ernie4_5_moe",
    model_types=("ernie4_5_moe",),
    block_classes=("Ernie4_5_MoeDecoderLayer",),
    tp_plan={**ATTENTION_TP_PLAN, **MLP_TP_PLAN, **SHARED_EXPERTS_TP_PLAN},
    moe=MoeLayout(classes=("Ernie4_5_MoeSparseMoeBlock",), num_experts="num_experts",
                  shared_expert="shared_experts", scoring="softmax_biased",
                  correction_bias="gate.moe_statics.e_score_correction_bias",
                  norm_min=FromConfig("moe_norm_min"), router_fp32=True),
)
