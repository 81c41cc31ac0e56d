"""Qwen2-MoE: Qwen2 attention (q/k/v bias) and, on every `decoder_sparse_step`-th layer not in
`mlp_only_layers`, a sparse MoE (top-k of the fp32 softmax, renormalized when norm_topk_prob,
weights cast to the logits' dtype) plus a shared expert scaled by sigmoid(shared_expert_gate(x));
the other layers have a dense gated MLP (Llama's gate/up/down names, also the shared expert's)."""

import dataclasses

from hf_dsinfer.injection.policies.llama import ATTENTION_TP_PLAN, MLP_TP_PLAN
from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import FromConfig, MoeLayout

POLICY = dataclasses.replace(
    LLAMA,
    family="qwen2_moe",
    model_types=("qwen2_moe",),
    block_classes=("Qwen2MoeDecoderLayer",),
    # HF's base_model_tp_plan also slices the experts and leaves the shared expert whole; ours
    # keeps the experts whole (expert parallelism) and slices attention, the dense layers' MLP
    # and the shared expert. The router and the shared expert's gate are replicated.
    tp_plan={**ATTENTION_TP_PLAN, **MLP_TP_PLAN,
             "mlp.shared_expert.gate_proj": "colwise", "mlp.shared_expert.up_proj": "colwise",
             "mlp.shared_expert.down_proj": "rowwise"},
    moe=MoeLayout(classes=("Qwen2MoeSparseMoeBlock",), num_experts="num_experts",
                  renormalize=FromConfig("norm_topk_prob"), shared_expert="shared_expert",
                  shared_expert_gate="shared_expert_gate"),
)
