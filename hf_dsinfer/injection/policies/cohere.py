"""Cohere (Command R, `cohere`) and Cohere 2 (Command R7B / Command A, `cohere2`): attention and
MLP in parallel off one LayerNorm, summed as (x + attention) + MLP (`parallel_residual_first`);
Cohere's LayerNorm has no bias and multiplies its weight in fp32 (`LAYER_FP32`); RoPE over
interleaved pairs whose tables HF already repeats pairwise, with q and k rotated in fp32 from
the model's bf16 tables (`rope_fp32_math`). The logit scale is HF's own code in the causal-LM
head. Cohere 2 adds sliding / full `layer_types`: its attention's `sliding_window` is None on
full layers, which rotate nothing (NoPE: `rope_attr`).

Cohere's `use_qk_norm` (Command R+) norms q and k with a weight per head ([heads, head_dim]):
the attention's own CohereLayerNorms run on [B, S, heads, D] (`QK_NORM_MODULE`); tensor
parallelism, which would slice the heads but not those weights, is refused for such configs.
The native decode layer computes pre-norm blocks only: these blocks take torch
ops at batch-1 decode, and explain names the reason."""

import dataclasses

from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import LAYER_FP32, PARALLEL_SHARED_LN, QK_NORM_MODULE, FromConfig

POLICY = dataclasses.replace(
    LLAMA,
    family="cohere",
    model_types=("cohere",),
    block_classes=("CohereDecoderLayer",),
    layout=PARALLEL_SHARED_LN,
    parallel_residual_first=True,
    norm=LAYER_FP32,
    ln2=None,
    rotary_interleaved=True,
    rope_fp32_math=True,
    qk_norm=FromConfig("use_qk_norm", {True: QK_NORM_MODULE, False: None}, False),
    notes="",
)

POLICY_2 = dataclasses.replace(
    POLICY,
    family="cohere2",
    model_types=("cohere2",),
    block_classes=("Cohere2DecoderLayer",),
    rope_attr="sliding_window",
    qk_norm=None,
)
