"""Policies are validated when defined: a typo in a family file fails at import, naming the
field, the value and the choices."""

from __future__ import annotations

import dataclasses

import pytest

from hf_dsinfer.errors import PolicyError
from hf_dsinfer.injection import policy as P
from hf_dsinfer.injection.policies import POLICIES, llama, mixtral


def test_every_registered_policy_is_valid():
    for policy in POLICIES:  # defined at import, so validated already; replace re-validates
        assert dataclasses.replace(policy) == policy


@pytest.mark.parametrize("change, message", [
    ({"layout": "sequentail"}, r"layout='sequentail' is not one of \['sequential'"),
    ({"norm": "rmsnorm"}, r"norm='rmsnorm' is not one of"),
    ({"qkv_layout": "fused"}, r"qkv_layout='fused' is not one of"),
    ({"positions": "rotary"}, r"positions='rotary' is not one of"),
    ({"qk_norm": "head"}, r"qk_norm='head' is not one of"),
    ({"qkv": ("q_proj", "k_proj")}, r"reads 3 projection\(s\), but qkv names 2"),
    ({"qkv": "qkv_proj"}, r"qkv must be a non-empty tuple of attribute names"),
    ({"mlp_in": ()}, r"mlp_in must be a non-empty tuple"),
    ({"gated": False}, r"a plain MLP reads at most 1"),
    ({"layout": P.SANDWICH}, r"layout=SANDWICH needs post_attn_norm"),
    ({"post_mlp_norm": "post_feedforward_layernorm"}, r"only read by layout=SANDWICH"),
    ({"ln1": None}, r"ln1=None \(no pre-norm\) only with layout=SANDWICH"),
    ({"tp_plan": {"self_attn.q_proj": "column"}}, r"style='column' is not one of"),
    ({"layout": P.FromConfig("x", {True: P.PARALLEL, False: "paralel"})}, r"'paralel'"),
    ({"rope_pairs_table": True}, r"needs positions=ROPE and rotary_interleaved=True"),
    ({"rope_pairs_table": True, "rotary_interleaved": True, "rope_half_table": True},
     r"a policy takes one"),
    ({"qk_norm_after_rope": True}, r"it needs qk_norm=QK_NORM_HEAD, got None"),
    ({"rope_optional": True, "positions": P.NO_POSITIONS}, r"rope_optional .* needs positions=ROPE"),
    ({"qk_norm": P.QK_NORM_HEAD, "qk_norm_attrs": ("q_norm",)}, r"names the q and the k norm"),
    ({"rope_sliding_only": True}, r"rope_sliding_only .* needs sliding_attr and positions=ROPE"),
    ({"rope_fp32_math": True, "positions": P.NO_POSITIONS}, r"rope_fp32_math .* needs positions"),
    ({"parallel_residual_first": True}, r"orders the sum of layout=PARALLEL_SHARED_LN"),
    ({"parallel_residual_first": True,  # a FromConfig layout that is never parallel
      "layout": P.FromConfig("x", {True: P.PARALLEL, False: P.SEQUENTIAL})}, r"orders the sum"),
    ({"norm_eps": 0}, r"norm_eps must be a positive number or None"),
    ({"activation_module": "act_fn"}, r"activation_module names the activation module of a plain"),
    ({"qk_norm_heads_first": True}, r"qk_norm_heads_first .* needs qk_norm=QK_NORM_MODULE"),
    ({"unsupported_when": (("use_qk_norm", True),)}, r"\(config attribute, value, reason\)"),
    ({"rope_sliding_only": True, "sliding_attr": "is_sliding", "positions": P.NO_POSITIONS},
     r"needs sliding_attr and positions=ROPE"),
])
def test_a_typo_fails_when_the_policy_is_defined(change, message):
    with pytest.raises(PolicyError, match=message):
        dataclasses.replace(llama.POLICY, **change)


def test_moe_layout_is_validated():
    assert mixtral.POLICY.moe is not None
    with pytest.raises(PolicyError, match="shared_expert_gate without a shared_expert"):
        dataclasses.replace(mixtral.POLICY.moe, shared_expert_gate="shared_expert_gate")
    with pytest.raises(PolicyError, match="classes must be a non-empty tuple"):
        dataclasses.replace(mixtral.POLICY.moe, classes=())
    with pytest.raises(PolicyError, match="router_args must be a tuple"):
        dataclasses.replace(mixtral.POLICY.moe, router_args="e_score_correction_bias")
    with pytest.raises(PolicyError, match="top_k_module must be a dotted attribute path"):
        dataclasses.replace(mixtral.POLICY.moe, top_k_module=("gate", "top_k"))
    for scoring in ("softmax_biased", "sigmoid_group"):
        with pytest.raises(PolicyError, match=f"scoring='{scoring}' reads a correction_bias"):
            dataclasses.replace(mixtral.POLICY.moe, scoring=scoring)
