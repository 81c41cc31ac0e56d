"""Cohere / Cohere 2's numerics, piece by piece against HF's own modules (the family grid in
test_family_parity holds the whole models to HF eager within its tolerances; these hold the
new options to HF's bits, so each would fail if the option were dropped):

- Cohere's LayerNorm (`layer_norm_fp32`): fp32 statistics, no bias, the weight multiply in
  fp32 and one rounding; a [heads, head_dim] weight over [..., heads, head_dim];
- RoPE in fp32 from bf16 tables (`rope_fp32_math`), over pairs from HF's interleaved tables;
- the parallel block's sum as (x + attention) + MLP (`parallel_residual_first`);
- Cohere 2's full layers NoPE and without a window;
- `use_qk_norm` (per-head norm weights): the attention's own norms, inside the fused block."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import CONFIGS, make_model, prompts
from transformers import AutoModelForCausalLM
from transformers.models.cohere import modeling_cohere as hf_cohere

import hf_dsinfer
from hf_dsinfer.errors import UnsupportedModelError
from hf_dsinfer.injection.walker import get_report
from hf_dsinfer.kernels.norms import layer_norm_fp32
from tests.injection.test_layer_norm_families import assert_qk_norm_modules_run


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 5, 96), (3, 5, 6, 16)])  # hidden; per-head q / k norm
def test_layer_norm_fp32_is_cohere_layer_norm(dtype, shape):
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=gen) + 0.5).to(dtype)
    hf = hf_cohere.CohereLayerNorm(shape[2:], eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.3 * torch.randn(hf.weight.shape, generator=gen))
        hf.to(dtype)
        out, h = layer_norm_fp32(x, hf.weight, 1e-5)
        assert h is x
        assert torch.equal(out, hf(x))



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_layer_norm_is_not_those_bits(dtype):
    """Why the style exists: torch's LayerNorm (the "layer" norm) rounds elsewhere; over 64
    rows of 1024 values it gave other bits in 15 of 512 bf16 rows and most fp32 rows (Zen 4)."""
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(64, 1024, generator=gen) + 0.5).to(dtype)
    weight = (1 + 0.3 * torch.randn(1024, generator=gen)).to(dtype)
    out, _ = layer_norm_fp32(x, weight, 1e-5)
    assert not torch.equal(torch.nn.functional.layer_norm(x, (1024,), weight, None, 1e-5), out)


def _fused(name: str, dtype=torch.bfloat16):
    ref = make_model(name, dtype=dtype)
    fused = hf_dsinfer.init_inference(copy.deepcopy(ref))
    return ref, fused, list(get_report(fused).blocks.values())


def test_rotation_in_fp32_from_bf16_tables_is_hfs(monkeypatch):
    ref, _, blocks = _fused("cohere")
    ids, _ = prompts()
    with torch.no_grad():
        cos, sin = ref.model.rotary_emb(ref.model.embed_tokens(ids), torch.arange(ids.shape[1])[None])
    assert cos.dtype == torch.bfloat16  # HF's tables in the model's dtype
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(ids.shape[0], 6, ids.shape[1], 16, generator=gen).to(torch.bfloat16)
    k = torch.randn(ids.shape[0], 3, ids.shape[1], 16, generator=gen).to(torch.bfloat16)
    want = hf_cohere.apply_rotary_pos_emb(q, k, cos, sin)
    got = blocks[0]._rotate(q, k, {"position_embeddings": (cos, sin)})
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # the products rounded to bf16 (the option dropped) give other bits
    monkeypatch.setattr(blocks[0], "policy", blocks[0].policy.__class__(
        **{**blocks[0].policy.__dict__, "rope_fp32_math": False}))
    rounded = blocks[0]._rotate(q, k, {"position_embeddings": (cos, sin)})
    assert not torch.equal(rounded[0], want[0])


def test_parallel_sum_is_residual_first(monkeypatch):
    """(x + attention) + MLP in bf16, as Cohere's block adds them (not GPT-J's order)."""
    _, _, blocks = _fused("cohere")
    block = blocks[0]
    gen = torch.Generator().manual_seed(2)
    x, a, m = (torch.randn(2, 3, 96, generator=gen).to(torch.bfloat16) * s for s in (8, 1, 1))
    monkeypatch.setattr(block, "_attention", lambda h, named: (a, None))
    monkeypatch.setattr(block, "_mlp", lambda h: (m, None))
    out = block._parallel_shared_ln(x, {})
    assert torch.equal(out, (x + a) + m)
    assert not torch.equal(out, (a + m) + x)  # the data tells the two orders apart


def test_cohere2_full_layers_are_nope_without_a_window():
    _, _, blocks = _fused("cohere2", dtype=torch.float32)
    assert [b.spec.rope for b in blocks] == [True, False, True]
    assert [b.spec.window for b in blocks] == [4, None, 4]


def test_use_qk_norm_runs_cohere_s_own_norms():
    """Command R+'s use_qk_norm: the attention's CohereLayerNorms ([heads, head_dim] weights)
    run on [B, S, heads, D] inside the fused block (QK_NORM_MODULE)."""
    config = CONFIGS["cohere"]()
    config.use_qk_norm = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.add_(0.3 * torch.randn(norm.weight.shape, generator=gen))
    assert_qk_norm_modules_run(model, "use_qk_norm")


def test_unsupported_when_refuses_with_the_reason(monkeypatch):
    """A config value a policy names in unsupported_when is refused with the reason (no
    shipped policy needs it now that Cohere's use_qk_norm runs), or runs unmodified."""
    import dataclasses

    from hf_dsinfer.injection import policies

    refusing = dataclasses.replace(
        policies.cohere.POLICY,
        unsupported_when=(("use_qk_norm", True, "q / k norms with a weight per head"),))
    monkeypatch.setattr(policies, "POLICIES", tuple(
        refusing if p is policies.cohere.POLICY else p for p in policies.POLICIES))
    config = CONFIGS["cohere"]()
    config.use_qk_norm = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(UnsupportedModelError, match=r"a weight per head .*use_qk_norm=True"):
        hf_dsinfer.init_inference(copy.deepcopy(model))
    with pytest.warns(UserWarning, match="running unmodified"):
        kept = hf_dsinfer.init_inference(copy.deepcopy(model), strict=False)
    assert "use_qk_norm" in hf_dsinfer.explain(kept)
    ids, mask = prompts()
    with torch.no_grad():
        assert torch.equal(kept(ids, attention_mask=mask).logits,
                           model(ids, attention_mask=mask).logits)