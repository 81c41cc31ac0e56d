"""Weight-only int8 / int4 on the 2026 families (bf16): the quantized fused model computes what
HF computes with the dequantized weights (so every feature option of the block runs on quantized
linears), every block linear is quantized, and greedy decoding runs fused."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import FAMILIES_2026, make_model, prompts

import hf_dsinfer
from hf_dsinfer.injection.quantize import QuantizedLinear
from hf_dsinfer.kernels.quant import dequantize_int4, dequantize_int8

# bf16 rounding only: the dequantized HF run and the fused run round in a different order
BF16_REL_L2 = 3e-2
QUANTS = {"int8": {"bits": 8}, "int4": {"bits": 4, "group_size": 32}}
GEN = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "pad_token_id": 0}


def _dequantized_copy(ref: torch.nn.Module, fused: torch.nn.Module) -> torch.nn.Module:
    """`ref` with every weight the fused model quantized replaced by its dequantized value. A
    head tied to the embedding (SmolLM3) gets an untied copy: the fused model quantizes an
    int8 copy of the head and keeps the table for lookups."""
    out = copy.deepcopy(ref)
    with torch.no_grad():
        for path, module in fused.named_modules():
            if isinstance(module, QuantizedLinear) and ".dsinfer_quantized." not in path:
                dequantize = dequantize_int8 if module.bits == 8 else dequantize_int4
                weight = dequantize(module.quantized, torch.bfloat16)
                old = out.get_submodule(path)
                if old is out.get_output_embeddings():  # untied, and its bias kept (Phi)
                    bias = getattr(old, "bias", None)
                    head = torch.nn.Linear(weight.shape[1], weight.shape[0],
                                           bias=bias is not None).to(torch.bfloat16)
                    if bias is not None:
                        head.bias.copy_(bias)
                    out.set_output_embeddings(head)
                out.get_submodule(path).weight.copy_(weight)
    return out


@pytest.mark.parametrize("quant", list(QUANTS))
@pytest.mark.parametrize("name", FAMILIES_2026)
def test_quantized_family_matches_hf_on_dequantized_weights(name, quant):
    ref = make_model(name, dtype=torch.bfloat16)
    fused = hf_dsinfer.init_inference(copy.deepcopy(ref), quant=QUANTS[quant])
    report = hf_dsinfer.injection.walker.get_report(fused)
    slots = [m for f in report.blocks.values() for _, _, m in f.linear_slots()]
    assert slots and all(isinstance(m, QuantizedLinear) and m.bits == QUANTS[quant]["bits"]
                         for m in slots)
    ref = _dequantized_copy(ref, fused)
    ids, mask = prompts()
    calls = sum(hf_dsinfer.fused_call_counts(fused).values())
    with torch.no_grad():
        a = ref(ids, attention_mask=mask).logits.float()
        b = fused(ids, attention_mask=mask).logits.float()
    assert sum(hf_dsinfer.fused_call_counts(fused).values()) > calls
    valid = mask.bool()
    rel = (a[valid] - b[valid]).norm() / a[valid].norm()
    assert rel <= BF16_REL_L2, rel.item()
    out = fused.generate(ids, attention_mask=mask, **GEN)
    assert out.shape[1] == ids.shape[1] + GEN["max_new_tokens"]
