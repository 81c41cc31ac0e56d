"""Every supported family, fused vs HF eager, on tiny random models (fp32 and bf16).

fp32: logits within 1e-4 and tokens identical for greedy, a left-padded batch, beam search,
seeded sampling, the static cache and use_cache=False. bf16: logits within BF16_LOGIT_RTOL of
their scale and greedy tokens identical, except where HF's own logits show a near-tie.
Call counters prove the fused blocks ran.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import FAMILIES, ROPE_SCALINGS, make_model, prompts
from transformers import AutoModelForCausalLM

import hf_dsinfer

FP32_LOGIT_ATOL = 1e-4
# bf16 keeps 8 mantissa bits: fused kernels round in a different order than HF eager (SDPA's
# fp32-accumulating attention, fused residual+norm), measured max |diff| ~1.5% of max |logit|.
BF16_LOGIT_RTOL = 3e-2
NEW_TOKENS = 24
GEN = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "pad_token_id": 0}


def _pair(name: str, dtype=torch.float32, **kwargs):
    ref = make_model(name, dtype=dtype, **kwargs)
    fused = hf_dsinfer.init_inference(copy.deepcopy(ref))
    return ref, fused


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    return _pair(request.param)


def _calls(model) -> int:
    return sum(hf_dsinfer.fused_call_counts(model).values())


def _generate_both(ref, fused, ids, mask, **kwargs):
    before = _calls(fused)
    out = []
    for model in (ref, fused):
        torch.manual_seed(1234)
        out.append(model.generate(ids, attention_mask=mask, **GEN, **kwargs))
    assert _calls(fused) > before, "fused blocks did not run"
    return out


def test_logits_match_hf_eager(pair):
    ref, fused = pair
    ids, mask = prompts()
    with torch.no_grad():
        a = ref(ids, attention_mask=mask).logits
        before = _calls(fused)
        b = fused(ids, attention_mask=mask).logits
    assert _calls(fused) == before + len(hf_dsinfer.fused_call_counts(fused))
    valid = mask.bool()  # padded positions are never read
    assert (a - b)[valid].abs().max().item() <= FP32_LOGIT_ATOL


def test_greedy_24_tokens(pair):
    ref, fused = pair
    ids, mask = prompts(batch=1)
    a, b = _generate_both(ref, fused, ids, mask, do_sample=False)
    assert torch.equal(a, b)


def test_left_padded_batch(pair):
    ref, fused = pair
    ids, mask = prompts(batch=3)
    a, b = _generate_both(ref, fused, ids, mask, do_sample=False)
    assert torch.equal(a, b)


def test_beam_search(pair):
    ref, fused = pair
    ids, mask = prompts(batch=2)
    a, b = _generate_both(ref, fused, ids, mask, num_beams=3, do_sample=False)
    assert torch.equal(a, b)


def test_seeded_sampling(pair):
    ref, fused = pair
    ids, mask = prompts(batch=3)
    a, b = _generate_both(ref, fused, ids, mask, do_sample=True, top_k=20, temperature=0.9)
    assert torch.equal(a, b)


def test_static_cache(pair):
    ref, fused = pair
    ids, mask = prompts(batch=2)
    a, b = _generate_both(ref, fused, ids, mask, do_sample=False, cache_implementation="static")
    assert torch.equal(a, b)


@pytest.mark.parametrize("batch", [1, 2])
def test_static_cache_logits(pair, batch):
    """Every step's logits, not only tokens: a no-padding prefill into a longer static cache
    gets mask=None from HF (SDPA's top-left causal rule), a case token checks alone missed."""
    ref, fused = pair
    ids, mask = prompts(batch=batch)
    kwargs = {"do_sample": False, "cache_implementation": "static", "output_logits": True,
              "return_dict_in_generate": True, **GEN, "max_new_tokens": 6, "min_new_tokens": 6}
    a = ref.generate(ids, attention_mask=mask, **kwargs)
    b = fused.generate(ids, attention_mask=mask, **kwargs)
    for la, lb in zip(a.logits, b.logits):
        assert (la - lb).abs().max().item() <= FP32_LOGIT_ATOL


def test_without_cache(pair):
    ref, fused = pair
    ids, mask = prompts(batch=2)
    a, b = _generate_both(ref, fused, ids, mask, do_sample=False, use_cache=False)
    assert torch.equal(a, b)


def test_inference_mode(pair):
    ref, fused = pair
    ids, mask = prompts(batch=2)
    with torch.inference_mode():
        a = ref.generate(ids, attention_mask=mask, do_sample=False, **GEN)
        b = fused.generate(ids, attention_mask=mask, do_sample=False, **GEN)
        la, lb = ref(ids, attention_mask=mask).logits, fused(ids, attention_mask=mask).logits
    assert torch.equal(a, b)
    assert (la - lb)[mask.bool()].abs().max().item() <= FP32_LOGIT_ATOL


@pytest.mark.parametrize("rope", list(ROPE_SCALINGS))
def test_llama_rope_scaling(rope):
    ref, fused = _pair("llama", rope_scaling=ROPE_SCALINGS[rope])
    ids, mask = prompts(batch=2, lengths=(40, 33))  # past the 32 original positions
    with torch.no_grad():
        a, b = ref(ids, attention_mask=mask).logits, fused(ids, attention_mask=mask).logits
    assert (a - b)[mask.bool()].abs().max().item() <= FP32_LOGIT_ATOL
    a, b = _generate_both(ref, fused, ids, mask, do_sample=False)
    assert torch.equal(a, b)


def test_sdpa_masks_match_eager():
    """The fused attention reads whichever mask format the model builds (sdpa: bool or None)."""
    ref = make_model("llama", attn_implementation="eager")
    fused = hf_dsinfer.init_inference(make_model("llama", attn_implementation="sdpa"))
    ids, mask = prompts(batch=3)
    a, b = _generate_both(ref, fused, ids, mask, do_sample=False)
    assert torch.equal(a, b)


def _first_divergence_is_near_tie(ref_out, fused_seq, prompt_len: int, tol: float) -> None:
    """Per row: tokens identical, or at the first flip HF's own top logits are within tol."""
    ref_seq = ref_out.sequences
    for row in range(ref_seq.shape[0]):
        diff = (ref_seq[row, prompt_len:] != fused_seq[row, prompt_len:]).nonzero()
        if diff.numel() == 0:
            continue
        step = int(diff[0])
        logits = ref_out.logits[step][row].float()
        hf_tok, fused_tok = ref_seq[row, prompt_len + step], fused_seq[row, prompt_len + step]
        gap = float(logits[hf_tok] - logits[fused_tok])
        assert gap <= tol, f"row {row} step {step}: HF prefers its token by {gap:.3f} > {tol}"


@pytest.mark.parametrize("name", FAMILIES)
def test_bf16(name):
    ref, fused = _pair(name, dtype=torch.bfloat16)
    ids, mask = prompts(batch=3)
    with torch.no_grad():
        a = ref(ids, attention_mask=mask).logits.float()
        b = fused(ids, attention_mask=mask).logits.float()
    valid = mask.bool()
    scale = a[valid].abs().max().item()
    assert (a - b)[valid].abs().max().item() <= BF16_LOGIT_RTOL * scale
    before = _calls(fused)
    ref_out = ref.generate(ids, attention_mask=mask, do_sample=False, output_logits=True,
                           return_dict_in_generate=True, **GEN)
    fused_seq = fused.generate(ids, attention_mask=mask, do_sample=False, **GEN)
    assert _calls(fused) > before
    _first_divergence_is_near_tie(ref_out, fused_seq, ids.shape[1], BF16_LOGIT_RTOL * scale)


def test_hyperclovax_without_post_norms_is_granites_block():
    """HyperCLOVA X's layout is a FromConfig of use_post_norm: without post-norms (its layers
    hold nn.Identity there) the block is Granite's sequential one, fp32 logits within 1e-4 and
    the same greedy tokens."""
    from tiny_models import CONFIGS

    from hf_dsinfer.injection import policy as P
    from hf_dsinfer.injection.walker import get_report

    config = CONFIGS["hyperclovax"]()
    config.use_post_norm = False
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    fused = hf_dsinfer.init_inference(copy.deepcopy(ref))
    assert {f.spec.layout for f in get_report(fused).blocks.values()} == {P.SEQUENTIAL}
    ids, mask = prompts()
    with torch.no_grad():
        a = ref(ids, attention_mask=mask).logits
        b = fused(ids, attention_mask=mask).logits
    assert (a - b)[mask.bool()].abs().max().item() <= FP32_LOGIT_ATOL
    x, y = _generate_both(ref, fused, ids[:1], mask[:1], do_sample=False)
    assert torch.equal(x, y)
