"""Phi-1 / Phi-1.5 / Phi-2 (`phi`): GPT-J's parallel block (attention and MLP off one
nn.LayerNorm, summed as (attention + MLP) + x) with separate biased q / k / v projections, the
output projection `dense`, partial rotary (the first partial_rotary_factor of each head's dims,
rotate-half) and a plain biased MLP `fc1` -> tanh GELU -> `fc2`. The final LayerNorm and the
biased LM head are HF's model-level code and run unchanged.

Phi's `qk_layernorm` (one LayerNorm over each head's dims, off in the released checkpoints)
runs as the attention's own modules on [B, heads, S, D] (`QK_NORM_MODULE`)."""

import dataclasses

from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import LAYER, PARALLEL_SHARED_LN, QK_NORM_MODULE, FromConfig

POLICY = dataclasses.replace(
    LLAMA,
    family="phi",
    model_types=("phi",),
    block_classes=("PhiDecoderLayer",),
    layout=PARALLEL_SHARED_LN,
    norm=LAYER,
    ln2=None,
    out_proj="dense",
    mlp_in=("fc1",),
    mlp_out="fc2",
    gated=False,
    qk_norm=FromConfig("qk_layernorm", {True: QK_NORM_MODULE, False: None}, False),
    qk_norm_attrs=("q_layernorm", "k_layernorm"),
    qk_norm_heads_first=True,
    notes="",
)
