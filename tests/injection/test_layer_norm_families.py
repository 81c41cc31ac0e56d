"""The LayerNorm families' numerics, piece by piece against HF's own modules (the family grid in
test_family_parity holds the whole models to HF eager within its tolerances; these hold the
new options to HF's bits, so each would fail if the option were dropped):

- OLMo's LayerNorm without parameters (`LAYER_PLAIN`: fp32, one rounding; its epsilon from
  the policy, as the module keeps none);
- Nemotron's LayerNorm1P (`LAYER_1P`: the weight read as 1 + w);
- StableLM's parallel configs: no second norm (the block has none), (x + attention) + MLP;
- Phi's and StableLM's `qk_layernorm`: the attention's own norms, inside the fused block."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import CONFIGS, assert_fp32_matches_hf, make_model, prompts
from transformers import AutoModelForCausalLM
from transformers.models.nemotron import modeling_nemotron as hf_nemotron
from transformers.models.olmo import modeling_olmo as hf_olmo

import hf_dsinfer
from hf_dsinfer.injection.walker import get_report
from hf_dsinfer.kernels.norms import layer_norm_plain


def _fused(name: str, dtype=torch.bfloat16):
    ref = make_model(name, dtype=dtype)
    fused = hf_dsinfer.init_inference(copy.deepcopy(ref))
    return ref, fused, list(get_report(fused).blocks.values())


def _x(dtype, *shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(*shape, generator=gen) + 0.5).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layer_norm_plain_is_olmos(dtype):
    x, residual = _x(dtype, 3, 5, 96), _x(dtype, 3, 5, 96, seed=1)
    out, h = layer_norm_plain(x, 1e-5, residual)
    assert torch.equal(h, residual + x)
    assert torch.equal(out, hf_olmo.OlmoLayerNorm(96)(residual + x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_blocks_norms_are_hfs_to_the_bit(dtype):
    """Each block's two norms through FusedBlock._norm_add (the residual add fused) equal the
    HF module applied to the sum: OLMo's (eps from the policy) and Nemotron's 1 + w."""
    for name, cls in (("olmo", hf_olmo.OlmoLayerNorm),
                      ("nemotron", hf_nemotron.NemotronLayerNorm1P)):
        _, _, blocks = _fused(name, dtype)
        x, residual = _x(dtype, 2, 4, 96), _x(dtype, 2, 4, 96, seed=1)
        for fused in blocks:
            for norm in (fused._ln1, fused._ln2):
                assert type(norm) is cls
                with torch.no_grad():
                    out, _ = fused._norm_add(norm, x, residual, None)
                    assert torch.equal(out, norm(residual + x)), name


def test_nemotrons_norm_reads_one_plus_w():
    """Why LAYER_1P exists: the randomized weights (about 0) read as w give another norm."""
    _, _, blocks = _fused("nemotron")
    norm = blocks[0]._ln1
    x = _x(torch.bfloat16, 2, 4, 96)
    with torch.no_grad():
        plain = torch.nn.functional.layer_norm(x, (96,), norm.weight, norm.bias, norm.eps)
        assert (plain - blocks[0]._norm(norm, x)).abs().max() > 0.5


def test_olmos_norms_need_the_policys_epsilon():
    from hf_dsinfer.injection.fused import _norm_eps

    norm = hf_olmo.OlmoLayerNorm(8)
    with pytest.raises(AttributeError, match="norm_eps"):
        _norm_eps(norm)
    assert _norm_eps(norm, 1e-5) == 1e-5
    _, _, blocks = _fused("olmo")
    assert blocks[0].policy.norm_eps == 1e-5


def test_stablelm_parallel_reads_one_norm_and_sums_x_plus_attention_first():
    ref, fused, blocks = _fused("stablelm_parallel")
    assert all(b.block.post_attention_layernorm is None and b._ln2 is None for b in blocks)
    assert blocks[0].spec.layout == "parallel_shared_ln"
    assert blocks[0].policy.parallel_residual_first
    _, _, sequential = _fused("stablelm")
    assert sequential[0].spec.layout == "sequential" and sequential[0]._ln2 is not None
    ids, mask = prompts()
    calls = sum(b.calls for b in blocks)
    with torch.no_grad():
        a = ref(ids, attention_mask=mask).logits
        b = fused(ids, attention_mask=mask).logits
    assert sum(b_.calls for b_ in blocks) > calls
    valid = mask.bool()
    assert (a[valid] - b[valid]).abs().max() < 0.1


def _qk_layernorm_model(name: str, dtype=torch.float32):
    config = CONFIGS[name]()
    config.qk_layernorm = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights 1, biases 0 from HF: noise makes every head's own count
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                for t in (module.weight, module.bias):
                    if t is not None:
                        t.add_((0.3 * torch.randn(t.shape, generator=gen)).to(t.dtype))
    return model


def assert_qk_norm_modules_run(model, switch: str) -> None:
    """An fp32 model whose q / k norms run as the attention's own modules (QK_NORM_MODULE):
    the fused copy gives HF eager's logits (1e-4) and greedy tokens, its blocks ran, and the
    norms bite (HF with each attention's `switch` flag off gives other logits)."""
    fused = hf_dsinfer.init_inference(copy.deepcopy(model))
    blocks = list(get_report(fused).blocks.values())
    assert all(b.spec.qk_norm == "module" for b in blocks)
    ids, mask = prompts()
    gen = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        want = model(ids, attention_mask=mask).logits
        got = fused(ids, attention_mask=mask).logits
        assert torch.equal(fused.generate(ids, attention_mask=mask, **gen),
                           model.generate(ids, attention_mask=mask, **gen))
        for layer in model.model.layers:
            setattr(layer.self_attn, switch, False)
        without = model(ids, attention_mask=mask).logits
    valid = mask.bool()
    assert sum(b.calls for b in blocks) > 0
    assert (got - want)[valid].abs().max() <= 1e-4
    assert (without - want)[valid].abs().max() > 1e-2


@pytest.mark.parametrize("name", ["phi", "stablelm"])
def test_qk_layernorm_runs_the_attentions_own_norms(name):
    """Phi's shared and StableLM's per-head q / k LayerNorms, on [B, heads, S, D]."""
    assert_qk_norm_modules_run(_qk_layernorm_model(name), "qk_layernorm")


def test_qk_layernorm_bf16_and_explain():
    model = _qk_layernorm_model("stablelm", torch.bfloat16)
    fused = hf_dsinfer.init_inference(copy.deepcopy(model))
    ids, mask = prompts()
    with torch.no_grad():
        a = model(ids, attention_mask=mask).logits.float()
        b = fused(ids, attention_mask=mask).logits.float()
    valid = mask.bool()
    assert (a[valid] - b[valid]).norm() / a[valid].norm() <= 3e-2
    with torch.inference_mode():
        fused.generate(ids[:1], max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert "q / k LayerNorms" in hf_dsinfer.explain(fused)  # why the native layer does not run


@pytest.mark.parametrize("name", ["stablelm", "cohere"])
def test_per_head_qk_norms_refuse_tensor_parallelism_before_slicing(name):
    """StableLM's per-head LayerNorms and Cohere's [heads, head_dim] weights are not sliced
    with the heads: the plan refuses tp > 1 for such configs, naming the fix; Phi's shared
    norm is sliceable (one weight for every head)."""
    from hf_dsinfer.errors import TensorParallelError
    from hf_dsinfer.injection.policies import find_policy
    from hf_dsinfer.parallel.plan import plan_block

    config = CONFIGS[name]()
    setattr(config, "qk_layernorm" if name == "stablelm" else "use_qk_norm", True)
    model = AutoModelForCausalLM.from_config(config).eval()
    policy = find_policy(model)
    block = model.model.layers[0]
    with pytest.raises(TensorParallelError, match="tp_size=1"):
        plan_block(block, policy, config, 0, 2, 0)
    plan_block(block, policy, config, 0, 1, 0)  # one rank: nothing sliced
    phi = _qk_layernorm_model("phi")
    plan_block(phi.model.layers[0], find_policy(phi), phi.config, 0, 2, 0)


def test_gpt_bigcode_without_multi_query_reads_q_k_v_per_head():
    """GPTBigCode packs q / k / v as [q | k | v] under multi_query (StarCoder 1, SantaCoder: the
    grid's model) and as [q, k, v] per head otherwise: both are GROUPED_GQA (one group, or a
    group per head). The per-head packing: fp32 logits within 1e-4 of HF, 5 KV heads, the same
    greedy tokens, fused calls counted."""
    config = CONFIGS["gpt_bigcode"]()
    config.multi_query = False
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    fused = hf_dsinfer.init_inference(copy.deepcopy(ref))
    assert [b.spec.num_kv_heads for b in get_report(fused).blocks.values()] == [5, 5]
    assert_fp32_matches_hf(ref, fused)
