"""A plain MLP whose activation is a module with learned parameters (Apertus's xIELU) runs it
inside the fused block as HF's own module (`Policy.activation_module`): its live parameters
count, the fused path ran, and the native decode layer stands aside with the reason."""

from __future__ import annotations

import copy

import torch
from tiny_models import make_model, prompts

import hf_dsinfer
from hf_dsinfer.injection.walker import get_report


def test_apertus_runs_each_layers_own_xielu():
    ref = make_model("apertus")
    fused = hf_dsinfer.init_inference(copy.deepcopy(ref))
    blocks = list(get_report(fused).blocks.values())
    assert all(b.spec.activation == "module" and b._act_module is b.block.mlp.act_fn
               for b in blocks)
    ids, mask = prompts()
    valid = mask.bool()
    with torch.no_grad():
        before = ref(ids, attention_mask=mask).logits
        for model in (ref, fused):  # the same change to layer 1's activation in both
            model.model.layers[1].mlp.act_fn.alpha_p.add_(1.0)
        want = ref(ids, attention_mask=mask).logits
        calls = sum(b.calls for b in blocks)
        got = fused(ids, attention_mask=mask).logits
    assert sum(b.calls for b in blocks) > calls
    assert (want - before)[valid].abs().max() > 1e-2  # the parameter counts
    assert (got - want)[valid].abs().max() <= 1e-4


def test_apertus_bf16_decode_names_why_it_is_not_native():
    fused = hf_dsinfer.init_inference(make_model("apertus", dtype=torch.bfloat16))
    with torch.inference_mode():
        fused.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False,
                       pad_token_id=0)
    assert "an MLP the C layer computes" in hf_dsinfer.explain(fused)
