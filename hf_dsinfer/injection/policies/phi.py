"""Phi-1 / Phi-1.5 / Phi-2 (`phi`): GPT-J's parallel block (attention and MLP off one
nn.LayerNorm, summed as (attention + MLP) + x) with separate biased q / k / v projections, the
output projection `dense`, partial rotary (the first partial_rotary_factor of each head's dims,
rotate-half) and a plain biased MLP `fc1` -> tanh GELU -> `fc2`. The final LayerNorm and the
biased LM head are HF's model-level code and run unchanged.

Phi's `qk_layernorm` (a LayerNorm over each head's dims, off in the released checkpoints) is
refused with that reason: the fused block's q / k norms are RMSNorms."""

import dataclasses

from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import LAYER, PARALLEL_SHARED_LN

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
    unsupported_when=(("qk_layernorm", True,
                       "LayerNorms of q and k over each head's dims (Phi's qk_layernorm)"),),
    notes="",
)
