"""HunYuan (dense, `hunyuan_v1_dense`): Llama's block with per-head RMSNorms of q and k
(`query_layernorm`, `key_layernorm`) applied after RoPE, not before as Qwen3's; its NTK-alpha
RoPE is HF's rotary module and runs unchanged. The native decode layer norms the rotated q and
k too (hfd_layer.qk_norm_after_rope). HF gives
it no base_model_tp_plan: tensor parallelism slices Llama's way (the norms' [head_dim] weights
replicated)."""

import dataclasses

from hf_dsinfer.injection.policies.llama import ATTENTION_TP_PLAN, MLP_TP_PLAN
from hf_dsinfer.injection.policies.llama import POLICY as LLAMA
from hf_dsinfer.injection.policy import QK_NORM_HEAD

POLICY = dataclasses.replace(
    LLAMA,
    family="hunyuan_v1_dense",
    model_types=("hunyuan_v1_dense",),
    block_classes=("HunYuanDenseV1DecoderLayer",),
    qk_norm=QK_NORM_HEAD,
    qk_norm_attrs=("query_layernorm", "key_layernorm"),
    qk_norm_after_rope=True,
    tp_plan={**ATTENTION_TP_PLAN, **MLP_TP_PLAN},
    notes="",
)
