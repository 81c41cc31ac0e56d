"""ERNIE 4.5 (dense): Llama's block with biases on every projection or none (`use_bias`), and
RoPE over interleaved pairs (dims 2i, 2i + 1, GPT-J's layout) from Llama's cos / sin tables,
which it reads as their first half repeated pairwise. Its tables stay fp32 and the rotation
runs in fp32, rounded once (as OLMo 2's). The native decode layer rotates the same pairs
(csrc/cpu_decode.c: ROPE_FP32_PAIRS)."""

import dataclasses

from hf_dsinfer.injection.policies.llama import POLICY as LLAMA

POLICY = dataclasses.replace(
    LLAMA,
    family="ernie4_5",
    model_types=("ernie4_5",),
    block_classes=("Ernie4_5DecoderLayer",),
    rotary_interleaved=True,
    rope_pairs_table=True,
    notes="",
)
