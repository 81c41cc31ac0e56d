"""Falcon's block wirings and q / k / v packings beyond the grid's two models.

The grid (test_family_parity, test_hf_contract, TP) runs `falcon` (the new decoder architecture
with ln_attn / ln_mlp, 3 query heads per KV head) and `falcon_7b` (multi-query off one norm).
Here the other configs transformers builds: Falcon2-11B's new architecture off one norm, the old
architecture without multi_query (a group per head), the sequential block; the refusals; and
the KV cache, which keeps the KV heads where HF's new architecture keeps a copy per query head."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import CONFIGS, assert_fp32_matches_hf, prompts
from transformers import AutoModelForCausalLM, DynamicCache

import hf_dsinfer
from hf_dsinfer.errors import PolicyError
from hf_dsinfer.hf.cache_args import KEYWORD
from hf_dsinfer.injection.walker import get_report

VARIANTS = {  # name: (config changes, expected BlockSpec.describe() prefix)
    "falcon2_11b": ({"num_ln_in_parallel_attn": 1}, "parallel_shared_ln, layer_norm, 6q/2kv"),
    "old_mha": ({"new_decoder_architecture": False, "multi_query": False, "num_kv_heads": None},
                "parallel_shared_ln, layer_norm, 6q/6kv"),
    "sequential": ({"new_decoder_architecture": False, "parallel_attn": False, "multi_query": True},
                   "sequential, layer_norm, 6q/1kv"),
}


def _model(seed: int = 0, **changes):
    config = CONFIGS["falcon"]()
    for key, value in changes.items():
        setattr(config, key, value)
    if config.num_kv_heads is None:
        config.num_kv_heads = config.num_attention_heads
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # LayerNorms and biases off their initial 1 / 0, so each counts
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                params = (module.weight, module.bias)
            elif isinstance(module, torch.nn.Linear) and module.bias is not None:
                params = (module.bias,)
            else:
                continue
            for t in params:
                t.add_(0.2 * torch.randn(t.shape, generator=gen))
    return model.eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_falcon_wirings_match_hf(variant):
    changes, described = VARIANTS[variant]
    ref = _model(**changes)
    fused = hf_dsinfer.init_inference(copy.deepcopy(ref))
    blocks = list(get_report(fused).blocks.values())
    assert blocks and all(b.spec.describe().startswith(described) for b in blocks), \
        [b.spec.describe() for b in blocks]
    assert_fp32_matches_hf(ref, fused)


def test_falcon_new_architecture_caches_the_kv_heads():
    """HF's new-architecture attention broadcasts k and v to every query head before its cache;
    the fused block caches the KV heads (2 of 6 here): a third of the memory, the same logits."""
    ref = _model()
    fused = hf_dsinfer.init_inference(copy.deepcopy(ref))
    ids, mask = prompts()
    caches = {}
    for name, model in (("hf", ref), ("fused", fused)):
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(ids, attention_mask=mask, **{KEYWORD: cache})
        caches[name] = cache.layers[0].keys.shape
    assert caches["hf"][1] == 6 and caches["fused"][1] == 2, caches
    assert caches["hf"][2:] == caches["fused"][2:]


def test_falcon_alibi_is_refused_with_the_reason():
    ref = _model(alibi=True, new_decoder_architecture=False, parallel_attn=False)
    with pytest.raises(hf_dsinfer.UnsupportedModelError, match="ALiBi"):
        hf_dsinfer.init_inference(copy.deepcopy(ref))
    kept = hf_dsinfer.init_inference(ref, strict=False)
    assert sum(hf_dsinfer.fused_call_counts(kept).values()) == 0
    assert "ALiBi" in hf_dsinfer.explain(kept)


def test_falcon_wiring_transformers_cannot_run_is_refused():
    """The old architecture with two norms builds ln_attn / ln_mlp but its forward reads
    input_layernorm, so transformers fails: the policy maps no such wiring and says so."""
    ref = _model(new_decoder_architecture=False, multi_query=True, num_ln_in_parallel_attn=2)
    with pytest.raises(AttributeError):
        ref(torch.tensor([[3, 4, 5]]))
    with pytest.raises(PolicyError, match=r"num_ln_in_parallel_attn.*\(True, False, 2\)"):
        hf_dsinfer.init_inference(ref)
    assert not hf_dsinfer.fused_call_counts(ref)  # nothing was installed
