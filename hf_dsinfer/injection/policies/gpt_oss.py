"""gpt-oss: Llama's block (GQA, q/k/v/o biases) with a learned attention-sink logit per head in
every softmax, sliding / full layers alternating (`layer_types`, through HF's masks per layer),
RMSNorms that multiply by the weight in fp32, cos / sin of the D/2 frequencies only, and a
sparse MoE in every layer: a router with a bias, top-k of its logits then a softmax over those
k, and experts stored transposed (`x @ W`) with interleaved gate / up columns, biases on both
projections and a clamped SwiGLU `(clamp(up) + 1) * g * sigmoid(alpha * g)`. The MoE module
returns (hidden, router scores). HF has no base_model_tp_plan for it; ours slices attention
Megatron-style (q/k/v with their biases by heads, o_proj by its input, its bias added once after
the all-reduce, the sinks with their heads) and keeps the experts whole on every rank: ep_size
shards them."""

import dataclasses

from hf_dsinfer.injection.policies.llama import ATTENTION_TP_PLAN
from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import RMS_FP32, FromConfig, MoeLayout

POLICY = dataclasses.replace(
    LLAMA,
    family="gpt_oss",
    model_types=("gpt_oss",),
    block_classes=("GptOssDecoderLayer",),
    norm=RMS_FP32,
    mlp_in=(),
    mlp_out="",
    rope_half_table=True,
    sinks_attr="sinks",
    tp_plan=ATTENTION_TP_PLAN,
    moe=MoeLayout(classes=("GptOssMLP",), num_experts="num_local_experts", router="router",
                  renormalize=False, softmax_first=False, experts_transposed=True,
                  gate_up_interleaved=True, expert_bias=True,
                  swiglu_alpha=FromConfig("swiglu_alpha"),
                  swiglu_limit=FromConfig("swiglu_limit"), returns_scores=True),
)
