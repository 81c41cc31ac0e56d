"""FlexOlmo (`flex_olmo`): OLMo 2's block (norms only after attention and the MLP, RMSNorm over
the whole q and k projections, fp32 weight multiply and rotary) with OLMoE's sparse MoE in
every layer (fp32 softmax top-k, renormalized per `norm_topk_prob`, weights cast to the
logits' dtype; no shared expert, no dense layer). Tensor parallelism slices attention by heads
with the q / k norm weights (the sum of squares all-reduced, as OLMo 2 / OLMoE) and keeps the
experts whole (ep_size shards them)."""

import dataclasses

from hf_dsinfer.injection.policies.llama import ATTENTION_TP_PLAN
from hf_dsinfer.injection.policies.olmo2 import POLICY as OLMO2
from hf_dsinfer.injection.policies.olmoe import POLICY as OLMOE

POLICY = dataclasses.replace(
    OLMO2,
    family="flex_olmo",
    model_types=("flex_olmo",),
    block_classes=("FlexOlmoDecoderLayer",),
    mlp_in=(),
    mlp_out="",
    tp_plan=ATTENTION_TP_PLAN,
    moe=dataclasses.replace(OLMOE.moe, classes=("FlexOlmoSparseMoeBlock",)),
)
