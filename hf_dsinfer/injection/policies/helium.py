"""Helium: Llama's block with an RMSNorm that multiplies its weight in fp32 (OLMo 2's numerics)
and RoPE over interleaved pairs (dims 2i, 2i + 1) from Llama's cos / sin tables, read as their
first half repeated pairwise; the rotation in the activations' dtype (the native decode
layer's ROPE_BF16_PAIRS)."""

import dataclasses

from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import RMS_FP32

POLICY = dataclasses.replace(
    LLAMA,
    family="helium",
    model_types=("helium",),
    block_classes=("HeliumDecoderLayer",),
    norm=RMS_FP32,
    rotary_interleaved=True,
    rope_pairs_table=True,
    notes="",
)
