"""GPTBigCode (`gpt_bigcode`: StarCoder 1, SantaCoder, WizardCoder): GPT-2's block (LayerNorm
pre-norms, learned positions, `c_fc` -> GELU -> `c_proj`) with nn.Linear weights and
multi-query attention packed as [q | k | v] in `c_attn` (one key / value head: Phi-3's
`PACKED_GQA` layout with the config's head counts). `multi_query=False` packs q / k / v per
head instead, which this policy does not read: such configs are refused with that reason."""

import dataclasses

from hf_dsinfer.injection.policies.gpt2 import POLICY as GPT2
from hf_dsinfer.injection.policy import PACKED_GQA

POLICY = dataclasses.replace(
    GPT2,
    family="gpt_bigcode",
    model_types=("gpt_bigcode",),
    block_classes=("GPTBigCodeBlock",),
    qkv_layout=PACKED_GQA,
    conv1d=False,
    cache_arg="layer_past",  # GPTBigCodeModel passes its cache (paged ones too) under this name
    unsupported_when=(("multi_query", False,
                       "q / k / v packed per head ([heads, 3 * head_dim]) when multi_query is "
                       "off"),),
    notes="",
)
