"""Phi-3 / Phi-4 (`phi3`): Llama's block with one fused projection `qkv_proj` whose output is
[q | k | v] (GQA: k and v of num_key_value_heads heads each), one fused `gate_up_proj` whose
output is [gate | up], partial rotary (partial_rotary_factor: cos / sin cover the first dims)
and longrope from the model's own rotary_emb, and a sliding window through HF's masks."""

import dataclasses

from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import PACKED_GQA

POLICY = dataclasses.replace(
    LLAMA,
    family="phi3",
    model_types=("phi3",),
    block_classes=("Phi3DecoderLayer",),
    qkv_layout=PACKED_GQA,
    qkv=("qkv_proj",),
    mlp_in=("gate_up_proj",),
    # HF's base_model_tp_plan gathers both fused outputs back to full width; ours slices
    # qkv_proj by this rank's q and KV heads and gate_up_proj by its rows of gate and of up.
    tp_plan={"self_attn.qkv_proj": "colwise", "self_attn.o_proj": "rowwise",
             "mlp.gate_up_proj": "colwise", "mlp.down_proj": "rowwise"},
)
