"""The one-token decode step as one loop over the native layers (injection/decode_step.py), for
one sequence and for a batch (the batched layer calls).

It must give exactly what HF's own layer loop gives with the same fused blocks (same kernels,
same cache updates), really run (its counter and the layers' counters), and hand every call it
cannot prove equal to HF's forward: hooks, hidden states, sliding windows, other caches."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, MistralConfig, StaticCache

import hf_dsinfer
from hf_dsinfer.injection.walker import get_report
from hf_dsinfer.kernels import _native
from tests.kernels.test_native_decode import _BASE  # the tiny Llama shape those tests use

pytestmark = pytest.mark.skipif(not _native.available(),
                                reason=f"native kernels unavailable: {_native.why_unavailable()}")



def _model(quant=None, config=None):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config or LlamaConfig(**_BASE),
                                             dtype=torch.bfloat16).eval()
    return hf_dsinfer.init_inference(model, dtype=torch.bfloat16, quant=quant)


def _steps(model, ids, mask, cache, steps=5):
    """Prefill, then `steps` greedy one-token steps; logits [steps, B, V]."""
    out = []
    with torch.inference_mode():
        logits = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits
        for _ in range(steps):
            tok = logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones(ids.shape[0], 1, dtype=mask.dtype)], dim=1)
            logits = model(tok, attention_mask=mask, past_key_values=cache, use_cache=True).logits
            out.append(logits[:, -1].float())
    return torch.stack(out)


def _cache(kind, model):
    if kind == "dynamic":
        return DynamicCache(config=model.config)
    return StaticCache(config=model.config, max_cache_len=32)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("quant", [None, {"bits": 8}, {"bits": 4, "group_size": 32}])
@pytest.mark.parametrize("padded", [False, True])
def test_step_equals_hf_layer_loop(cache, quant, padded, monkeypatch):
    model = _model(quant)
    step = get_report(model).step
    assert step is not None and step.reason() is None
    ids = torch.tensor([[0, 0, 17, 33, 41, 9]]) if padded else torch.tensor([[17, 33, 41, 9]])
    mask = (ids != 0).long()
    native = _steps(model, ids, mask, _cache(cache, model))
    assert step.calls == 5 and step.last_reason is None
    layer_calls = [f.calls for f in get_report(model).blocks.values()]
    monkeypatch.setattr(step, "_why_static", "off in this test")
    hf_loop = _steps(model, ids, mask, _cache(cache, model))
    assert step.calls == 5 and step.last_reason == "off in this test"
    # the HF loop ran the same native layers (their own counters), and gave the same logits
    assert all(f.calls > c for f, c in zip(get_report(model).blocks.values(), layer_calls))
    assert torch.equal(native, hf_loop)


@pytest.mark.skipif(not _native.amx_available(), reason="no AMX-BF16: batches take HF's loop")
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_batched_step_equals_hf_layer_loop(cache, monkeypatch):
    """Three sequences, left-padded by 0, 2 and 3 tokens (per-row positions and keep rows)."""
    model = _model()
    step = get_report(model).step
    ids = torch.tensor([[12, 17, 33, 41, 9], [0, 0, 17, 33, 4], [0, 0, 0, 8, 9]])
    mask = (ids != 0).long()
    native = _steps(model, ids, mask, _cache(cache, model))
    assert step.calls == 5 and step.last_reason is None
    rows = [f._decode.row_calls for f in get_report(model).blocks.values()]
    monkeypatch.setattr(step, "_why_static", "off in this test")
    hf_loop = _steps(model, ids, mask, _cache(cache, model))
    assert step.calls == 5
    assert all(f._decode.row_calls > c for f, c in zip(get_report(model).blocks.values(), rows))
    assert torch.equal(native, hf_loop)


def test_quantized_batches_go_to_hf():
    model = _model({"bits": 8})
    step = get_report(model).step
    ids = torch.tensor([[12, 17, 33], [0, 17, 33]])
    _steps(model, ids, (ids != 0).long(), DynamicCache(config=model.config), steps=2)
    assert step.calls == 0
    assert step.last_reason == "a layer's batched native path does not run here"


def test_generate_takes_the_step_under_no_grad_and_inference_mode():
    model = _model({"bits": 4, "group_size": 32})
    step = get_report(model).step
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        a = model.generate(ids, max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        b = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(a, b)
    assert step.calls == 10  # 5 one-token steps per call
    hf_dsinfer.revert(model)
    assert "forward" not in model.model.__dict__  # revert removes it
    with torch.inference_mode():
        assert model.generate(ids, max_new_tokens=2, do_sample=False).shape == (1, 6)


def test_calls_it_cannot_prove_equal_go_to_hf(monkeypatch):
    model = _model()
    step = get_report(model).step
    ids = torch.tensor([[17, 33, 41, 9]])
    cache = DynamicCache(config=model.config)
    tok = torch.tensor([[5]])
    with torch.inference_mode():
        model(ids, past_key_values=cache, use_cache=True)
        out = model(tok, past_key_values=cache, use_cache=True, output_hidden_states=True)
        assert len(out.hidden_states) == 3 and step.last_reason == "attentions or hidden states asked for"
        seen = []
        handle = model.model.layers[1].register_forward_hook(lambda m, a, o: seen.append(1))
        model(tok, past_key_values=cache, use_cache=True)
        assert seen == [1] and step.last_reason == "hooks on a decoder layer"
        handle.remove()
        model(torch.tensor([[5, 6]]), past_key_values=cache, use_cache=True)
        assert step.last_reason == "not one token of 1-256 sequences on the CPU"
        float_mask = torch.zeros(1, cache.get_seq_length() + 1)
        model(tok, attention_mask=float_mask, past_key_values=cache, use_cache=True)
        assert step.last_reason == "an attention mask other than padding"
        with monkeypatch.context() as m:
            m.setenv(_native.ENV_VAR, "0")
            model(tok, past_key_values=cache, use_cache=True)
            assert step.last_reason.startswith("native kernels unavailable")
        assert step.calls == 0
        model(tok, past_key_values=cache, use_cache=True)  # and back, the layers not marked failed
        assert step.calls == 1 and step.last_reason is None
    with torch.enable_grad():
        model(tok, past_key_values=cache, use_cache=True)
    assert step.last_reason == "grad, training or torch.compile tracing"


def test_sliding_window_models_keep_hf_loop():
    model = _model(config=MistralConfig(**_BASE, sliding_window=6))
    step = get_report(model).step
    assert step.reason() == "sliding-window attention (its mask is per layer)"
    with torch.inference_mode():
        model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=3, do_sample=False)
    assert step.calls == 0
    assert "each called by HF's layer loop (sliding-window" in hf_dsinfer.explain(model)
