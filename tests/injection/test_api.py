"""Public API contracts: config validation, unsupported models, the parity gate, revert,
explain, and no process-wide state."""

from __future__ import annotations

import copy
import dataclasses
import re
import warnings

import pytest
import torch
from switches import switch
from tiny_models import make_model, prompts

import hf_dsinfer
from hf_dsinfer.injection import walker
from hf_dsinfer.injection.policies import find_policy
from hf_dsinfer.injection.walker import get_report


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


# -- config ----------------------------------------------------------------------------------------
def test_config_json_round_trip():
    cfg = hf_dsinfer.DSInferConfig(dtype=torch.bfloat16, kernels="ref", strict=True)
    again = hf_dsinfer.DSInferConfig.from_json(cfg.to_json())
    assert again == cfg and again.dtype is torch.bfloat16
    assert hf_dsinfer.DSInferConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.kernels = "auto"


@pytest.mark.parametrize("bad, needle", [
    ({"kernel": "auto"}, "Did you mean 'kernels'"),
    ({"parity_chek": True}, "Did you mean 'parity_check'"),
    ({"strict": "yes"}, "strict"),
    ({"parity_check": 1}, "parity_check"),
    ({"kernels": "cuda"}, "kernels"),
    ({"dtype": "float8"}, "dtype"),
])
def test_config_errors_name_key_and_fix(bad, needle):
    with pytest.raises(ValueError, match=needle) as info:
        hf_dsinfer.DSInferConfig.from_dict(bad)
    assert "expected" in str(info.value) or "Valid keys" in str(info.value)


def test_bad_dsinfer_argument_and_overrides():
    model = make_model("gpt2")
    with pytest.raises(ValueError, match="dsinfer="):
        hf_dsinfer.init_inference(model, "fast")
    with pytest.raises(ValueError, match="Did you mean 'kernels'"):
        hf_dsinfer.init_inference(model, kernel="ref")
    hf_dsinfer.init_inference(model, kernels="ref")
    assert get_report(model).config.kernels == "ref"


# -- unsupported models ------------------------------------------------------------------------------
def test_unsupported_raises_naming_class_and_families():
    model = make_model("xglm")
    with pytest.raises(hf_dsinfer.UnsupportedModelError) as info:
        hf_dsinfer.init_inference(model)
    text = str(info.value)
    assert "XGLMForCausalLM" in text and "llama" in text and "gpt_neox" in text
    assert "strict=False" in text
    assert walker.get_report(model) is None


def test_unsupported_names_what_the_block_lacks():
    model = make_model("qwen3_next")
    with pytest.raises(hf_dsinfer.UnsupportedModelError) as info:
        hf_dsinfer.init_inference(model)
    text = str(info.value)
    assert "Qwen3NextForCausalLM" in text and "Gated DeltaNet" in text
    assert "qwen3 (qwen3)" in text and "gemma2 (gemma2)" in text  # the 2026 families listed
    xglm = str(pytest.raises(hf_dsinfer.UnsupportedModelError, hf_dsinfer.init_inference,
                            make_model("xglm")).value)
    assert "No policy maps its decoder block" in xglm
    ministral3 = str(pytest.raises(hf_dsinfer.UnsupportedModelError, hf_dsinfer.init_inference,
                                   make_model("ministral3")).value)
    assert "Ministral3ForCausalLM" in ministral3 and "llama_4_scaling_beta" in ministral3


def test_lacking_names_real_model_types_no_policy_covers():
    """Every entry of policies.LACKING is a model_type transformers knows, and none is one a
    policy covers (a family added later must leave the list)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from hf_dsinfer.injection.policies import LACKING, supported_families
    covered = {t for types in supported_families().values() for t in types}
    assert not [t for t in LACKING if t not in CONFIG_MAPPING_NAMES]
    assert not [t for t in LACKING if t in covered]


def test_unsupported_non_strict_runs_unmodified():
    ref = make_model("xglm")
    model = copy.deepcopy(ref)
    with pytest.warns(UserWarning, match="unmodified"):
        hf_dsinfer.init_inference(model, strict=False)
    assert "unmodified" in hf_dsinfer.explain(model)
    ids, mask = prompts()
    assert torch.equal(_logits(ref, ids, mask), _logits(model, ids, mask))


# -- parity gate ---------------------------------------------------------------------------------------
@pytest.fixture
def broken_policy(monkeypatch):
    """A wrong policy (GPT-J style interleaved rotary on a Llama): what the gate must catch."""
    def wrong(model):
        return dataclasses.replace(find_policy(model), rotary_interleaved=True)
    monkeypatch.setattr(walker, "find_policy", wrong)


def test_parity_gate_falls_back_and_warns(broken_policy):
    ref = make_model("llama")
    model = copy.deepcopy(ref)
    with pytest.warns(UserWarning, match="parity gate failed"):
        hf_dsinfer.init_inference(model)
    assert "kept HF forward" in hf_dsinfer.explain(model)
    assert "FAILED" in hf_dsinfer.explain(model)
    ids, mask = prompts()
    assert torch.equal(_logits(ref, ids, mask), _logits(model, ids, mask))
    assert sum(hf_dsinfer.fused_call_counts(model).values()) == 0


def test_parity_gate_strict_raises(broken_policy):
    model = make_model("llama")
    with pytest.raises(hf_dsinfer.ParityError, match="LlamaDecoderLayer"):
        hf_dsinfer.init_inference(model, strict=True)
    assert walker.get_report(model) is None
    assert "forward" not in model.model.layers[0].__dict__


def test_parity_gate_passes_quietly_on_correct_policy():
    model = make_model("bloom")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf_dsinfer.init_inference(model, strict=True)
    report = get_report(model)
    assert report.parity["BloomBlock"].passed and report.parity["BloomBlock"].blocks_checked == 2


def test_parity_gate_compares_each_block_on_hfs_input():
    """The gate hands each fused block the hidden states its HF twin got: a fused block 0 that
    is off by a lot leaves block 1's error at fp32 rounding (compounded, it would carry block
    0's). Without that, half-precision roundings summed over 30 layers failed SmolLM2's gate
    under torch's AVX2 kernels (test_smollm2.py)."""
    from hf_dsinfer.injection import parity

    model = make_model("llama")
    hf_dsinfer.init_inference(model)
    blocks = list(get_report(model).blocks.values())
    assert len(blocks) == 2

    def off_when_fused(_module, _args, output):
        if not blocks[0].enabled:
            return None
        return (output[0] + 1.0, *output[1:]) if isinstance(output, tuple) else output + 1.0

    handle = blocks[0].block.register_forward_hook(off_when_fused)
    try:
        ids, mask = parity._probe_inputs(model)
        reference, fused, _ = parity._hf_then_fused(model, blocks, ids, mask)
    finally:
        handle.remove()
    valid = mask.bool()
    assert parity._rel_err(fused[0][valid], reference[0][valid]) > 0.1
    assert parity._rel_err(fused[1][valid], reference[1][valid]) < 1e-5
    assert all(f.enabled for f in blocks)  # the probe leaves the switches as they were


# -- revert, explain, independence ----------------------------------------------------------------------
def test_revert_restores_hf_forward():
    ref = make_model("gpt_neox")
    model = hf_dsinfer.init_inference(copy.deepcopy(ref))
    assert "forward" in model.gpt_neox.layers[0].__dict__
    assert hf_dsinfer.revert(model) is model
    assert "forward" not in model.gpt_neox.layers[0].__dict__
    assert "not injected" in hf_dsinfer.explain(model)
    ids, mask = prompts()
    assert torch.equal(_logits(ref, ids, mask), _logits(model, ids, mask))


def test_explain_lists_replaced_and_left_alone():
    model = hf_dsinfer.init_inference(make_model("opt_post_ln"))
    text = hf_dsinfer.explain(model)
    assert "OPTDecoderLayer x2" in text and "post_ln" in text and "parity ok" in text
    assert "left alone" in text and "project_in" in text


def test_two_models_with_different_configs_coexist():
    a = hf_dsinfer.init_inference(make_model("llama"), kernels="ref")
    b = hf_dsinfer.init_inference(make_model("llama"), kernels="auto")
    plain = make_model("llama")
    ids, mask = prompts()
    la, lb, lp = (_logits(m, ids, mask) for m in (a, b, plain))
    valid = mask.bool()
    assert (la - lp)[valid].abs().max() <= 1e-4 and (lb - lp)[valid].abs().max() <= 1e-4
    assert get_report(a).config.kernels == "ref" and get_report(b).config.kernels == "auto"
    assert "forward" not in plain.model.layers[0].__dict__
    assert all(hf_dsinfer.fused_call_counts(a).values())


def test_output_attentions_defers_to_hf():
    ref = make_model("llama")
    model = hf_dsinfer.init_inference(copy.deepcopy(ref))
    ids, mask = prompts()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_attentions=True)
        expected = ref(ids, attention_mask=mask, output_attentions=True)
    assert out.attentions is not None and len(out.attentions) == 2
    assert torch.allclose(out.attentions[0], expected.attentions[0])


def test_kernels_env_var_sets_what_auto_means(monkeypatch):
    switch(monkeypatch, kernels="ref")
    model = hf_dsinfer.init_inference(make_model("llama"))
    assert walker.get_report(model).backend == "ref"
    assert {f.backend for f in walker.get_report(model).blocks.values()} == {"ref"}
    explicit = hf_dsinfer.init_inference(make_model("llama"), kernels="cpu")
    assert walker.get_report(explicit).backend == "cpu"
    switch(monkeypatch, kernels="auto")
    assert walker.get_report(hf_dsinfer.init_inference(make_model("llama"))).backend == "cpu"


_TURN_ON = {"compile=True": {"compile": True}, "cache='dynamic'": {"cache": "dynamic"},
            "cache='static'": {"cache": "static"}, "quant": {"quant": {"bits": 8}},
            "tp_size > 1": {"tp_size": 2}, "ep_size > 1": {"ep_size": 2}, "offload": {"offload": {}},
            "pp_size > 1": {"pp_size": 2}}


def test_one_table_says_which_features_combine():
    """Every pair of features builds a config exactly when config.CONFLICTS does not list it."""
    from hf_dsinfer.config import CONFLICTS, FEATURES

    assert set(_TURN_ON) == set(FEATURES)
    banned = {frozenset((c.first, c.second)) for c in CONFLICTS}
    names = list(FEATURES)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if set(_TURN_ON[a]) & set(_TURN_ON[b]):
                continue  # two values of one field
            kwargs = {**_TURN_ON[a], **_TURN_ON[b]}
            if frozenset((a, b)) in banned:
                with pytest.raises(hf_dsinfer.DSInferConfigError,
                                   match=f"{re.escape(a)} cannot be combined with "
                                         f"{re.escape(b)}|{re.escape(b)} cannot be combined "
                                         f"with {re.escape(a)}"):
                    hf_dsinfer.DSInferConfig(**kwargs)
            else:
                hf_dsinfer.DSInferConfig(**kwargs)
