"""StableLM (`stablelm`: StableLM-3B-4E1T, StableLM 2): Llama's gated SiLU MLP and GQA attention
with nn.LayerNorm pre-norms, optional q / k / v biases (`use_qkv_bias`) and partial rotary
(rotate-half over the first partial_rotary_factor of each head). `use_parallel_residual`
(StableLM 2 12B) runs attention and MLP off the input norm, summed as (x + attention) + MLP
(`parallel_residual_first`); otherwise the block is sequential.

`qk_layernorm` (StableLM 2 12B: a LayerNorm with its own weight for each head) is refused with
that reason: the fused block's q / k norms are RMSNorms sharing one weight over the heads."""

import dataclasses

from hf_dsinfer.injection.policies.llama import ATTENTION_TP_PLAN, MLP_TP_PLAN
from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import LAYER, PARALLEL_SHARED_LN, SEQUENTIAL, FromConfig

POLICY = dataclasses.replace(
    LLAMA,
    family="stablelm",
    model_types=("stablelm",),
    block_classes=("StableLmDecoderLayer",),
    layout=FromConfig("use_parallel_residual", {True: PARALLEL_SHARED_LN, False: SEQUENTIAL},
                      False),
    parallel_residual_first=True,
    norm=LAYER,
    tp_plan={**ATTENTION_TP_PLAN, **MLP_TP_PLAN},  # HF has none for StableLM
    unsupported_when=(("qk_layernorm", True,
                       "LayerNorms of q and k with a weight per head (StableLM's qk_layernorm)"),),
    notes="",
)
