"""Latency mode: weight-only int8/int4 quantization at load and the compiled decode step."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import make_model, prompts

import hf_dsinfer
from hf_dsinfer.config import QuantConfig
from hf_dsinfer.errors import QuantizationError
from hf_dsinfer.injection.quantize import QuantizedLinear, check_quant_supported

GEN = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False, "pad_token_id": 0}


def _sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))


@pytest.mark.parametrize("quant, min_sqnr, max_ratio", [
    ({"bits": 8}, 25.0, 0.40),
    ({"bits": 4, "group_size": 32}, 8.0, 0.50),
])
def test_quantized_blocks(quant, min_sqnr, max_ratio):
    ref = make_model("llama")
    model = hf_dsinfer.init_inference(copy.deepcopy(ref), quant=quant)
    head = model.get_output_embeddings()  # untied in this model: quantized to int8
    assert isinstance(head, QuantizedLinear) and head.bits == 8
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear) and m is not head]
    assert len(linears) == 2 * 7 and all(m.bits == quant["bits"] for m in linears)
    # the fp32 weights are gone: the footprint shows the compression
    assert model.get_memory_footprint() <= max_ratio * ref.get_memory_footprint()
    ids, mask = prompts()
    with torch.no_grad():
        a, b = ref(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits
    valid = mask.bool()
    assert _sqnr_db(a[valid], b[valid]) >= min_sqnr
    out = model.generate(ids, attention_mask=mask, **GEN)
    assert out.shape[1] == ids.shape[1] + 12
    assert all(hf_dsinfer.fused_call_counts(model).values())
    assert f"int{quant['bits']}" in hf_dsinfer.explain(model)


def test_output_head_on_kernel_library():
    """An untied head runs kernels.linear (counted) with HF's logits in fp32; revert restores
    it; with quant, a tied head gets an int8 copy and the embedding table stays for lookups."""
    ref = make_model("llama")
    model = hf_dsinfer.init_inference(copy.deepcopy(ref))
    head = model.get_output_embeddings()
    ids, mask = prompts()
    with torch.no_grad():
        a, b = ref(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits
    valid = mask.bool()
    assert head.forward.calls == 1 and (a - b)[valid].abs().max() <= 1e-4
    assert "output head lm_head: kernel-library linear" in hf_dsinfer.explain(model)
    hf_dsinfer.revert(model)
    assert "forward" not in head.__dict__
    tied = make_model("gpt2")  # GPT-2 ties lm_head to wte
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    table = tied.get_input_embeddings().weight.detach().clone()
    tied = hf_dsinfer.init_inference(tied, quant={"bits": 8})
    head = tied.get_output_embeddings()
    assert isinstance(head, QuantizedLinear) and head.bits == 8
    assert torch.equal(tied.get_input_embeddings().weight, table)  # lookups keep the table
    with torch.no_grad():
        logits = tied(ids, attention_mask=mask).logits
    assert torch.isfinite(logits).all()
    assert "output head lm_head: int8 weight-only" in hf_dsinfer.explain(tied)


def test_int8_quantized_hf_fallback_uses_same_weights():
    """A call the fused path defers to HF (output_attentions) runs the same int8 linears."""
    model = hf_dsinfer.init_inference(make_model("gpt2"), quant={"bits": 8})
    ids, mask = prompts()
    with torch.no_grad():
        fused = model(ids, attention_mask=mask).logits
        hf = model(ids, attention_mask=mask, output_attentions=True).logits
    assert (fused - hf)[mask.bool()].abs().max() <= 1e-4


@pytest.mark.parametrize("name, quant, needle", [
    ("gpt2", {"bits": 4, "group_size": 64}, "input sizes [80, 320]"),
    ("mistral", {"bits": 4}, "Fix: use quant={'bits': 8}"),
])
def test_int4_group_that_cannot_fit_fails_before_touching_model(name, quant, needle):
    model = make_model(name)
    with pytest.raises(QuantizationError, match="group_size") as info:
        hf_dsinfer.init_inference(model, quant=quant)
    assert needle in str(info.value)
    assert hf_dsinfer.fused_call_counts(model) == {}
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())


def test_unsupported_device_dtype_names_what_is_supported():
    with pytest.raises(QuantizationError, match="Supported") as info:
        check_quant_supported(QuantConfig(bits=4), torch.device("mps"), torch.bfloat16)
    assert "cpu" in str(info.value) and "bfloat16" in str(info.value)


def test_compiled_decode_same_tokens_and_no_recompile():
    from torch._dynamo.utils import counters

    ref = make_model("llama")
    model = hf_dsinfer.init_inference(copy.deepcopy(ref), compile=True)
    assert model.generation_config.cache_implementation == "static"
    ids, mask = prompts(batch=2)
    expected = ref.generate(ids, attention_mask=mask, **GEN)
    first = model.generate(ids, attention_mask=mask, **GEN)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0, "the decode step was not compiled"
    second = model.generate(ids, attention_mask=mask, **GEN)
    assert counters["stats"]["unique_graphs"] == graphs, "second call with same lengths recompiled"
    assert torch.equal(first, expected) and torch.equal(second, expected)
    hf_dsinfer.revert(model)
    assert model.generation_config.cache_implementation is None


@pytest.mark.parametrize("overrides, device, expected", [
    ({}, "cpu", (False, "dynamic")),            # auto on CPU: eager, HF's growing cache
    ({}, "cuda", (False, "dynamic")),           # auto on CUDA too (docs/gpu.md)
    ({"compile": True}, "cuda", (True, "static")),  # asked: static cache + CUDA graphs
    ({"compile": True}, "cpu", (True, "static")),
    ({"compile": False}, "cuda", (False, "dynamic")),
    ({"cache": "static"}, "cpu", (False, "static")),
    ({"tp_size": 2}, "cuda", (False, "dynamic")),  # collectives stay eager
])
def test_decode_mode_resolution(overrides, device, expected):
    from hf_dsinfer.injection.latency import resolve_decode_mode

    mode = resolve_decode_mode(hf_dsinfer.DSInferConfig(**overrides), torch.device(device))
    assert (mode.compile, mode.cache) == expected


def test_compile_with_dynamic_cache_is_rejected():
    with pytest.raises(ValueError, match="static KV cache"):
        hf_dsinfer.DSInferConfig(compile=True, cache="dynamic")


def test_static_cache_without_compile_matches_hf_and_stays_eager():
    from torch._dynamo.utils import counters

    ref = make_model("llama")
    model = hf_dsinfer.init_inference(copy.deepcopy(ref), cache="static")
    assert model.generation_config.cache_implementation == "static"
    ids, mask = prompts(batch=2)
    graphs = counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, **GEN)
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled
    assert torch.equal(out, ref.generate(ids, attention_mask=mask, **GEN))
    assert "static KV cache, eager decode step" in hf_dsinfer.explain(model)
