"""Apertus (`apertus`, Swiss AI's 8B / 70B): Llama's attention with per-head q / k RMSNorms
(Qwen3's option), pre-norms named attention_layernorm / feedforward_layernorm, and a plain MLP
up_proj -> xIELU -> down_proj whose activation has learned parameters per layer: it runs as the
MLP's own `act_fn` module (`activation_module`), HF's numerics by construction. llama3 RoPE
scaling comes from the model's own rotary_emb. The native decode layer does not compute xIELU:
torch ops, and explain says why."""

import dataclasses

from hf_dsinfer.injection.policies.llama import ATTENTION_TP_PLAN
from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import QK_NORM_HEAD

POLICY = dataclasses.replace(
    LLAMA,
    family="apertus",
    model_types=("apertus",),
    block_classes=("ApertusDecoderLayer",),
    ln1="attention_layernorm",
    ln2="feedforward_layernorm",
    qk_norm=QK_NORM_HEAD,
    mlp_in=("up_proj",),
    gated=False,
    activation_module="act_fn",
    # HF's plan also names the q / k norms (replicated); ours slices the linears only
    tp_plan={**ATTENTION_TP_PLAN, "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"},
    notes="",
)
