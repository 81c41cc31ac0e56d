"""The registry of injection policies: one module per model family."""

from __future__ import annotations

from typing import Any

from hf_dsinfer.injection.policies import (
    apertus,
    arcee,
    bloom,
    cohere,
    deepseek_v2,
    deepseek_v3,
    dots1,
    ernie4_5,
    ernie4_5_moe,
    exaone4,
    exaone_moe,
    falcon,
    flex_olmo,
    gemma,
    gemma2,
    gemma3,
    glm,
    glm4,
    glm4_moe,
    glm4_moe_lite,
    gpt2,
    gpt_bigcode,
    gpt_neox,
    gpt_oss,
    gptj,
    granite,
    granite_swa,
    granitemoe,
    granitemoeshared,
    helium,
    hunyuan_v1_dense,
    hunyuan_v1_moe,
    hyperclovax,
    jais2,
    llama,
    minicpm3,
    minimax_m2,
    mixtral,
    nemotron,
    olmo,
    olmo2,
    olmoe,
    opt,
    phi,
    phi3,
    qwen2_moe,
    qwen3,
    qwen3_moe,
    smollm3,
    solar_open,
    stablelm,
    starcoder2,
    vaultgemma,
    youtu,
)
from hf_dsinfer.injection.policy import Policy

POLICIES: tuple[Policy, ...] = (
    gpt2.POLICY, opt.POLICY, bloom.POLICY, gpt_neox.POLICY, gptj.POLICY, llama.POLICY,
    mixtral.POLICY, qwen2_moe.POLICY, qwen3_moe.POLICY, olmoe.POLICY, qwen3.POLICY,
    smollm3.POLICY, granite.POLICY, olmo2.POLICY, gemma.POLICY, gemma2.POLICY, gemma3.POLICY,
    phi3.POLICY, gpt_oss.POLICY, deepseek_v3.POLICY, vaultgemma.POLICY, ernie4_5.POLICY,
    helium.POLICY, hunyuan_v1_dense.POLICY, glm.POLICY, glm4.POLICY, granite_swa.POLICY,
    exaone4.POLICY, cohere.POLICY, cohere.POLICY_2,
    glm4_moe.POLICY, ernie4_5_moe.POLICY, minimax_m2.POLICY, dots1.POLICY,
    hunyuan_v1_moe.POLICY, flex_olmo.POLICY, starcoder2.POLICY, phi.POLICY, stablelm.POLICY,
    olmo.POLICY, nemotron.POLICY, arcee.POLICY, granitemoe.POLICY,
    deepseek_v2.POLICY, apertus.POLICY, granitemoeshared.POLICY, granitemoeshared.POLICY_SWA,
    jais2.POLICY, hyperclovax.POLICY, solar_open.POLICY, glm4_moe_lite.POLICY, youtu.POLICY,
    exaone_moe.POLICY, minicpm3.POLICY, gpt_bigcode.POLICY, falcon.POLICY,
)


# Families with no policy because their blocks compute what the fused block has no option for
# (config.model_type -> what it lacks); the refusal names it (issue 27). Read from transformers
# 5.24's modeling files.
_DELTANET = "Gated DeltaNet (linear attention) layers and sigmoid-gated attention output"
_MAMBA = "Mamba state-space mixer layers (a recurrent state, not a KV cache)"
_GEMMA3N = "AltUp and Laurel blocks and per-layer input embeddings"
_GEMMA4 = ("per-layer input embeddings, key / value states shared across layers, an RMSNorm of "
           "the values, keys used as values on global layers (attention_k_eq_v), a per-layer "
           "output scalar and head_dim per layer type")
LACKING: dict[str, str] = {
    "qwen3_next": _DELTANET,
    "qwen3_5": _DELTANET,
    "qwen3_5_text": _DELTANET,
    "qwen3_5_moe": _DELTANET,
    "qwen3_5_moe_text": _DELTANET,
    "olmo_hybrid": "Gated DeltaNet (linear attention) layers",
    "kimi_linear": "Kimi Delta Attention (linear attention) layers",
    "ministral3": ("position-dependent query scaling (queries times 1 + beta * log(1 + "
                   "floor(position / original_max_position_embeddings)), rope_parameters' "
                   "llama_4_scaling_beta)"),
    "gemma3n": _GEMMA3N,
    "gemma3n_text": _GEMMA3N,
    "gemma4": _GEMMA4,
    "gemma4_text": _GEMMA4,
    "lfm2": "gated short-convolution layers (LFM2's ShortConv, a rolling conv state)",
    "lfm2_moe": "gated short-convolution layers (LFM2's ShortConv, a rolling conv state)",
    **{t: _MAMBA for t in ("falcon_h1", "granitemoehybrid", "nemotron_h", "jamba", "bamba",
                           "zamba2")},
    **{t: ("chunked local attention (attention_chunk_size), queries scaled by position on "
           "NoPE layers (attn_temperature_tuning), an L2 norm of q and k, and a MoE whose "
           "router scores multiply the experts' inputs") for t in ("llama4", "llama4_text")},
    "phimoe": "SparseMixer routing (top-2 picked one by one, each softmax masked by jitter_eps)",
    "minimax": "lightning attention layers (linear attention with a decayed recurrent state)",
    "deepseek_v32": ("DeepSeek sparse attention: an indexer picks the top-k keys each query "
                     "attends to"),
    "diffllama": "differential attention (two softmax maps subtracted, with a learned lambda)",
    "bitnet": ("RMSNorms inside the attention (before o_proj) and the MLP (before "
               "down_proj): BitNet's sub-norms"),
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
