"""The registry of injection policies: one module per model family."""

from __future__ import annotations

from typing import Any

from hf_dsinfer.injection.policies import (
    bloom,
    gemma2,
    gemma3,
    gpt2,
    gpt_neox,
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
    smollm3.POLICY, granite.POLICY, olmo2.POLICY, gemma2.POLICY, gemma3.POLICY,
    phi3.POLICY,
)


def find_policy(model: Any) -> Policy | None:
    for policy in POLICIES:
        if policy.matches(model):
            return policy
    return None


def supported_families() -> dict[str, tuple[str, ...]]:
    """family -> the config.model_type values it covers."""
    return {p.family: p.model_types for p in POLICIES}
