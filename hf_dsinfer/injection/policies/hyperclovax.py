"""HyperCLOVA X SEED (`hyperclovax`): Granite's block (the attention multiplier as the softmax
scale, both branch outputs times `residual_multiplier` before the residual add) with, where the
config says `use_post_norm` (Peri-LN), an RMSNorm of each branch output before that product:
`x + post_norm(branch) * residual_multiplier`. The embedding multiplier and the logits'
multiplication by `logits_scaling` are HF's model-level code around the blocks and run
unchanged."""

import dataclasses

from hf_dsinfer.injection.policies.granite import POLICY as GRANITE
from hf_dsinfer.injection.policy import SANDWICH, SEQUENTIAL, FromConfig

POLICY = dataclasses.replace(
    GRANITE,
    family="hyperclovax",
    model_types=("hyperclovax",),
    block_classes=("HyperCLOVAXDecoderLayer",),
    layout=FromConfig("use_post_norm", {True: SANDWICH, False: SEQUENTIAL}, default=True),
    post_attn_norm="post_norm1",
    post_mlp_norm="post_norm2",
)
