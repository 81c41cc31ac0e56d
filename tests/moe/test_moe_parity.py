"""Fused MoE models vs HF eager on tiny random configs: Mixtral 8 experts top-2 and 4 experts
top-1, Qwen2-MoE (shared expert, a dense layer in between), Qwen3-MoE (per-head q/k norm), OLMoE
(whole-projection q/k norm, clip_qkv).

fp32: logits within 1e-4 on a left-padded batch, greedy tokens identical (and each padded row
equal to its prompt run alone), the fused MoE counters prove the fused path ran. bf16: the parity
gate passes and logits stay within 3% of their scale. Plus capacity-factor dropping, int8/int4
experts and the error paths.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import MOE_CONFIGS, MOE_MODELS, make_model, prompts
from transformers import AutoModelForCausalLM

import hf_dsinfer
from hf_dsinfer.errors import DSInferConfigError, MoeStateError, QuantizationError
from hf_dsinfer.injection.moe import drop_over_capacity
from hf_dsinfer.injection.parity import MOE_TIE_MARGIN
from hf_dsinfer.injection.quantize import QuantizedLinear
from hf_dsinfer.injection.walker import get_report
from hf_dsinfer.kernels import _native
from hf_dsinfer.kernels import moe as moe_kernels
from hf_dsinfer.kernels.quant import dequantize_int4, dequantize_int8
from tests.kernels.conftest import count_calls

FP32_LOGIT_ATOL = 1e-4
BF16_LOGIT_RTOL = 3e-2
GEN = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False, "pad_token_id": 0}


def _moe_calls(model) -> dict[str, int]:
    moe = get_report(model).moe  # the MoE modules (mlp, or Granite's block_sparse_moe)
    return {p: c for p, c in hf_dsinfer.fused_call_counts(model).items() if p in moe}


@pytest.fixture(scope="module", params=MOE_MODELS)
def pair(request):
    ref = make_model(request.param)
    fused = hf_dsinfer.init_inference(copy.deepcopy(ref), strict=True)
    return request.param, ref, fused


def test_logits_match_hf_eager_fp32(pair):
    name, ref, fused = pair
    ids, mask = prompts()
    before = _moe_calls(fused)
    with torch.no_grad():
        a = ref(ids, attention_mask=mask).logits
        b = fused(ids, attention_mask=mask).logits
    after = _moe_calls(fused)
    assert before and all(after[p] == before[p] + 1 for p in before), "fused MoE did not run"
    valid = mask.bool()
    assert (a[valid] - b[valid]).abs().max().item() <= FP32_LOGIT_ATOL, name


def test_greedy_padded_batch_identical(pair):
    _, ref, fused = pair
    ids, mask = prompts()
    before = sum(_moe_calls(fused).values())
    expected = ref.generate(ids, attention_mask=mask, **GEN)
    got = fused.generate(ids, attention_mask=mask, **GEN)
    assert sum(_moe_calls(fused).values()) > before
    assert torch.equal(got, expected)
    for row in range(ids.shape[0]):  # the padded batch equals each prompt run alone
        keep = mask[row].bool()
        alone = fused.generate(ids[row:row + 1, keep], **GEN)
        assert torch.equal(alone[0, -GEN["max_new_tokens"]:], got[row, -GEN["max_new_tokens"]:])


def test_explain_lists_fused_moe(pair):
    _, _, fused = pair
    text = hf_dsinfer.explain(fused)
    assert "FusedMoE" in text and "dropless" in text


def _hf_routing_ties(ref, fused, ids, mask) -> torch.Tensor:
    """[B, S] tokens whose HF routing, in some MoE layer, is a near-tie (the k-th and (k+1)-th
    expert probabilities within MOE_TIE_MARGIN): bf16 rounding may legally flip those."""
    ties = torch.zeros(ids.shape, dtype=torch.bool)
    moes = get_report(fused).moe

    def hook(moe):
        def record(_module, args):
            ties.__ior__(moe.routing_margin(args[0]) < MOE_TIE_MARGIN[torch.bfloat16])
        return record

    handles = [ref.get_submodule(p).register_forward_pre_hook(hook(m)) for p, m in moes.items()]
    with torch.no_grad():
        ref(ids, attention_mask=mask)
    for h in handles:
        h.remove()
    return ties


@pytest.mark.parametrize("name", MOE_MODELS)
def test_bf16_parity_gate_and_logits(name):
    ref = make_model(name, dtype=torch.bfloat16)
    fused = hf_dsinfer.init_inference(copy.deepcopy(ref), strict=True)  # gate must pass
    ids, mask = prompts()
    with torch.no_grad():
        a = ref(ids, attention_mask=mask).logits.float()
        b = fused(ids, attention_mask=mask).logits.float()
    ties = _hf_routing_ties(ref, fused, ids, mask)
    valid = mask.bool() & ~ties
    assert (ties & mask.bool()).sum() <= mask.sum() // 3, "too many near-ties to test anything"
    err = (a[valid] - b[valid]).abs().max() / a[valid].abs().max()
    assert err <= BF16_LOGIT_RTOL, (name, err.item())


@pytest.mark.skipif(not _native.available(), reason="native CPU kernels unavailable")
def test_bf16_decode_runs_the_native_expert_kernel(monkeypatch):
    """Batch-1 bf16 decode routes one row per expert: csrc/cpu_moe.c computes them (counted),
    and at every decode step each MoE layer's output matches HF's MoE block run on the same
    input (tokens whose HF routing is a near-tie are skipped: bf16 may legally flip them)."""
    calls = count_calls(monkeypatch, moe_kernels, "_native_moe_rows")
    ref = make_model("mixtral_8x2", dtype=torch.bfloat16)
    fused = hf_dsinfer.init_inference(copy.deepcopy(ref))
    moes = get_report(fused).moe
    checked, errors = [], []

    def hook(path, moe):
        def compare(module, args, output):
            x = args[0]
            if x.shape[1] != 1 or moe.routing_margin(x).min() < MOE_TIE_MARGIN[torch.bfloat16]:
                return
            want = type(module).forward(ref.get_submodule(path), x)
            want = want[0] if isinstance(want, tuple) else want
            got = output[0] if isinstance(output, tuple) else output
            errors.append(((got.float() - want.float()).abs().max() / want.abs().max()).item())
            checked.append(path)
        return compare

    handles = [fused.get_submodule(p).register_forward_hook(hook(p, m)) for p, m in moes.items()]
    ids, mask = prompts(batch=1)
    with torch.inference_mode():
        fused.generate(ids, attention_mask=mask, **GEN)
    for h in handles:
        h.remove()
    assert len(calls) >= (GEN["max_new_tokens"] - 1) * len(moes)  # every decode step and layer
    assert len(checked) >= GEN["max_new_tokens"] // 2, "too many near-ties to test anything"
    assert max(errors) <= 1e-2, errors


def test_revert_restores_hf_forwards():
    model = hf_dsinfer.init_inference(make_model("qwen2_moe"))
    moe = next(iter(get_report(model).moe.values())).module
    assert "forward" in moe.__dict__
    hf_dsinfer.revert(model)
    assert "forward" not in moe.__dict__ and get_report(model) is None


# -- capacity factor -----------------------------------------------------------------------------
def test_drop_over_capacity_keeps_top1_first():
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])  # expert 0: 3 top-1 + 1 top-2 slot
    weights = torch.full((4, 2), 0.5)
    kept_ids, kept_w = drop_over_capacity(ids, weights, num_experts=4, factor=1.5)  # cap 3
    assert kept_ids.tolist() == [[0, 1], [0, 2], [0, 1], [3, 4]]  # token 3's top-2 slot dropped
    assert kept_w[3, 1] == 0 and kept_w.sum() == 3.5


def test_capacity_factor_is_opt_in_and_lossy():
    ref = make_model("mixtral_8x2")
    ids, mask = prompts()
    big = hf_dsinfer.init_inference(copy.deepcopy(ref), moe_capacity_factor=100.0)
    small = hf_dsinfer.init_inference(copy.deepcopy(ref), moe_capacity_factor=0.25,
                                      parity_check=False)
    with torch.no_grad():
        a = ref(ids, attention_mask=mask).logits
        b = big(ids, attention_mask=mask).logits
        c = small(ids, attention_mask=mask).logits
    valid = mask.bool()
    assert (a[valid] - b[valid]).abs().max() <= FP32_LOGIT_ATOL  # nothing dropped
    assert (a[valid] - c[valid]).abs().max() > 1e-2  # tokens dropped
    assert "capacity 0.25" in hf_dsinfer.explain(small)
    with pytest.raises(DSInferConfigError, match="moe_capacity_factor"):
        hf_dsinfer.DSInferConfig(moe_capacity_factor=-1)


# -- quantized experts ---------------------------------------------------------------------------
def _quantizable_qwen2_moe() -> torch.nn.Module:
    """The tiny Qwen2-MoE with sizes int4 groups of 32 divide (and int8's CPU kernel takes: it
    needs input sizes that are multiples of 16)."""
    config = MOE_CONFIGS["qwen2_moe"]()
    config.update({"hidden_size": 64, "num_attention_heads": 4, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 64})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                            attn_implementation="eager").eval()


def _dequantized_copy(ref: torch.nn.Module, fused: torch.nn.Module) -> torch.nn.Module:
    """`ref` with every weight the fused model quantized replaced by its dequantized value:
    the HF computation the quantized fused model must reproduce."""
    out = copy.deepcopy(ref)
    with torch.no_grad():
        for path, module in fused.named_modules():
            if isinstance(module, QuantizedLinear) and ".dsinfer_quantized." not in path:
                out.get_submodule(path).weight.copy_(_dequantize(module))
        for path, moe in get_report(fused).moe.items():
            experts = out.get_submodule(path).experts
            weights = [_dequantize(q) for q in moe.quantized]
            experts.gate_up_proj.copy_(torch.stack(weights[0::2]))
            experts.down_proj.copy_(torch.stack(weights[1::2]))
    return out


def _dequantize(q: QuantizedLinear) -> torch.Tensor:
    return (dequantize_int8 if q.bits == 8 else dequantize_int4)(q.quantized, torch.bfloat16)


@pytest.mark.parametrize("bits", (8, 4))
def test_quantized_experts(bits):
    """Quantized experts compute what HF computes with the dequantized weights."""
    ref = _quantizable_qwen2_moe()
    fused = hf_dsinfer.init_inference(copy.deepcopy(ref), quant={"bits": bits, "group_size": 32}
                                      if bits == 4 else {"bits": 8})
    ref = _dequantized_copy(ref, fused)
    report = get_report(fused)
    moe = next(iter(report.moe.values()))
    assert moe.quantized is not None and not hasattr(moe.experts, "gate_up_proj")
    before, after = report.moe_quant
    # int4 keeps two packings (portable + torch's CPU layout, kernels/quant.py): ~0.6x of bf16
    assert after < before * (0.6 if bits == 8 else 0.65)
    ids, mask = prompts()
    calls = sum(_moe_calls(fused).values())
    with torch.no_grad():
        a = ref(ids, attention_mask=mask).logits.float()
        b = fused(ids, attention_mask=mask).logits.float()
    assert sum(_moe_calls(fused).values()) > calls
    valid = mask.bool()
    rel = (a[valid] - b[valid]).norm() / a[valid].norm()
    assert rel <= BF16_LOGIT_RTOL, rel.item()  # bf16 rounding only
    assert "experts quantized: int" in hf_dsinfer.explain(fused)
    fused.train()
    with pytest.raises(MoeStateError, match="quantized"):
        fused(ids, attention_mask=mask)


def test_int4_group_must_divide_expert_sizes():
    model = make_model("mixtral_8x2")  # intermediate 56: no int4 group size divides it
    with pytest.raises(QuantizationError, match="group_size"):
        hf_dsinfer.init_inference(model, quant={"bits": 4})
    assert get_report(model) is None  # left untouched
