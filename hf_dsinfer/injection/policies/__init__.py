"""The registry of injection policies: one module per model family."""

from __future__ import annotations

from typing import Any

from hf_dsinfer.injection.policies import (
    bloom,
    deepseek_v3,
    gemma,
    gemma2,
    gemma3,
    gpt2,
    gpt_neox,
    gpt_oss,
    gptj,
    granite,
    llama,
    mixtral,
    olmo2,
    olmoe,
    opt,
    phi3,
    qwen2_moe,
    qwen3,
    qwen3_moe,
    smollm3,
)
from hf_dsinfer.injection.policy import Policy

POLICIES: tuple[Policy, ...] = (
    gpt2.POLICY, opt.POLICY, bloom.POLICY, gpt_neox.POLICY, gptj.POLICY, llama.POLICY,
    mixtral.POLICY, qwen2_moe.POLICY, qwen3_moe.POLICY, olmoe.POLICY, qwen3.POLICY,
    smollm3.POLICY, granite.POLICY, olmo2.POLICY, gemma.POLICY, gemma2.POLICY, gemma3.POLICY,
    phi3.POLICY, gpt_oss.POLICY, deepseek_v3.POLICY,
)


# Families with no policy because their blocks compute what the fused block has no option for
# (config.model_type -> what it lacks); the refusal names it (issue 27).
LACKING: dict[str, str] = {
    "qwen3_next": "Gated DeltaNet (linear attention) layers and sigmoid-gated attention output",
    "qwen3_5_text": "Gated DeltaNet (linear attention) layers and sigmoid-gated attention output",
    "ministral3": ("position-dependent query scaling (queries times 1 + beta * log(1 + "
                   "floor(position / original_max_position_embeddings)), rope_parameters' "
                   "llama_4_scaling_beta)"),
}


def missing_features(model_type: str) -> str:
    """What the fused block lacks for a model type no policy names, as a sentence."""
    lacking = LACKING.get(model_type)
    if lacking is None:
        return ("No policy maps its decoder block onto the fused block's options (a family "
                "whose features the block has is one small file under injection/policies/).")
    return f"Its decoder blocks need what the fused block does not compute: {lacking}."


def find_policy(model: Any) -> Policy | None:
    for policy in POLICIES:
        if policy.matches(model):
            return policy
    return None


def supported_families() -> dict[str, tuple[str, ...]]:
    """family -> the config.model_type values it covers."""
    return {p.family: p.model_types for p in POLICIES}
