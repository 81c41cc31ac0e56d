"""HunYuan MoE (`hunyuan_v1_moe`, Hunyuan-A13B): HunYuan's dense attention (per-head q / k
RMSNorms after RoPE) and a sparse MoE in every layer: the router `gate.wg` (a GEMM in its
weight's dtype, which HF builds in fp32), fp32 softmax, top-k renormalized and cast to the
logits' dtype, k read from the router (HF resolves a per-layer `moe_topk` there), plus an
ungated shared MLP (`shared_mlp`) added after the experts. Tensor parallelism slices attention
and the shared MLP Megatron-style and keeps the routed experts whole (ep_size shards them)."""

import dataclasses

from hf_dsinfer.injection.policies.hunyuan_v1_dense import POLICY as HUNYUAN
from hf_dsinfer.injection.policies.llama import ATTENTION_TP_PLAN, MLP_TP_PLAN
from hf_dsinfer.injection.policy import MoeLayout

POLICY = dataclasses.replace(
    HUNYUAN,
    family="hunyuan_v1_moe",
    model_types=("hunyuan_v1_moe",),
    block_classes=("HunYuanMoEV1DecoderLayer",),
    # (MLP_TP_PLAN: the plan's check reads the policy's dense MLP names, which name the
    # shared MLP's linears here; no layer is dense)
    tp_plan={**ATTENTION_TP_PLAN, **MLP_TP_PLAN, "mlp.shared_mlp.gate_proj": "colwise",
             "mlp.shared_mlp.up_proj": "colwise", "mlp.shared_mlp.down_proj": "rowwise"},
    moe=MoeLayout(classes=("HunYuanMoEV1Moe",), num_experts="num_experts",
                  top_k_module="gate.top_k", router_linear="wg", shared_expert="shared_mlp"),
)
