"""GPTBigCode (`gpt_bigcode`: StarCoder 1, SantaCoder, WizardCoder): GPT-2's block (LayerNorm
pre-norms, learned positions, `c_fc` -> GELU -> `c_proj`) with nn.Linear weights and q / k / v
packed in `c_attn` per KV head as [q x (heads / KV heads), k, v] (Falcon's `GROUPED_GQA`): with
`multi_query` one group, [q | k | v] with one key / value head; without it a group per head,
[q, k, v] per head. The head counts come from `c_attn`'s width."""

import dataclasses

from hf_dsinfer.injection.policies.gpt2 import POLICY as GPT2
from hf_dsinfer.injection.policy import GROUPED_GQA

POLICY = dataclasses.replace(
    GPT2,
    family="gpt_bigcode",
    model_types=("gpt_bigcode",),
    block_classes=("GPTBigCodeBlock",),
    qkv_layout=GROUPED_GQA,
    conv1d=False,
    cache_arg="layer_past",  # GPTBigCodeModel passes its cache (paged ones too) under this name
    notes="",
)
