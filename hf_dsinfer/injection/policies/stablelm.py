"""StableLM (`stablelm`: StableLM-3B-4E1T, StableLM 2): Llama's gated SiLU MLP and GQA attention
with nn.LayerNorm pre-norms, optional q / k / v biases (`use_qkv_bias`) and partial rotary
(rotate-half over the first partial_rotary_factor of each head). `use_parallel_residual`
(StableLM 2 12B) runs attention and MLP off the input norm, summed as (x + attention) + MLP
(`parallel_residual_first`); otherwise the block is sequential.

`qk_layernorm` (StableLM 2 12B: a LayerNorm with its own weight for each head) runs as the
attention's own modules on [B, heads, S, D] (`QK_NORM_MODULE`); tensor parallelism, which would
slice the heads but not those per-head weights, is refused for such configs."""

import dataclasses

from hf_dsinfer.injection.policies.llama import ATTENTION_TP_PLAN, MLP_TP_PLAN
from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import (
    LAYER,
    PARALLEL_SHARED_LN,
    QK_NORM_MODULE,
    SEQUENTIAL,
    FromConfig,
)

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
    qk_norm=FromConfig("qk_layernorm", {True: QK_NORM_MODULE, False: None}, False),
    qk_norm_attrs=("q_layernorm", "k_layernorm"),
    qk_norm_heads_first=True,
    notes="",
)
