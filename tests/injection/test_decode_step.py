"""The one-token decode step as one loop over the native layers (injection/decode_step.py), for
one sequence and for a batch (the batched layer calls).

It must give exactly what HF's own layer loop gives with the same fused blocks (same kernels,
same cache updates), really run (its counter and the layers' counters), and hand every call it
cannot prove equal to HF's forward: hooks, hidden states, sliding windows, other caches."""

from __future__ import annotations

import pytest
import torch
from switches import switch
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    StaticCache,
)

import hf_dsinfer
from hf_dsinfer.injection.walker import get_report
from hf_dsinfer.kernels import _native
from tests.kernels.test_native_decode import _BASE  # the tiny Llama shape those tests use

pytestmark = [pytest.mark.skipif(not _native.builds(),
               reason=f"native kernels unavailable: {_native.why_unavailable()}"),
              pytest.mark.usefixtures("native_tier")]



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
    _step_against_hf_loop(model, cache, padded, monkeypatch)
    # HF's forward computed the final norm by its module: the step's kernel gave the same bits
    assert get_report(model).step.final_norms == 5


def test_final_norm_with_a_hook_runs_as_the_module():
    """A hook on the final norm (or a norm of another class than the blocks') keeps the
    module call, so the hook runs at every step."""
    model = _model()
    step = get_report(model).step
    seen = []
    handle = model.model.norm.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    ids = torch.tensor([[17, 33, 41, 9]])
    with torch.inference_mode():
        hooked = _steps(model, ids, torch.ones_like(ids), DynamicCache(config=model.config))
    assert step.calls == 5 and step.final_norms == 0 and len(seen) == 6  # prefill + 5 steps
    handle.remove()
    with torch.inference_mode():
        plain = _steps(model, ids, torch.ones_like(ids), DynamicCache(config=model.config))
    assert step.calls == 10 and step.final_norms == 5 and len(seen) == 6
    assert torch.equal(hooked, plain)
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    class Count(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            seen.append("accelerate")
            return args, kwargs

    add_hook_to_module(model.model.norm, Count())  # accelerate's, as device maps add it
    with torch.inference_mode():
        accelerated = _steps(model, ids, torch.ones_like(ids), DynamicCache(config=model.config))
    remove_hook_from_module(model.model.norm)
    assert step.calls == 15 and step.final_norms == 5 and seen.count("accelerate") == 6
    assert torch.equal(accelerated, plain)


def _step_against_hf_loop(model, cache, padded, monkeypatch) -> None:
    """5 one-token steps through the step, then through the model's own forward running the
    same native layers: the same logits and the same cache."""
    step = get_report(model).step
    assert step is not None and step.reason() is None
    ids = torch.tensor([[0, 0, 17, 33, 41, 9]]) if padded else torch.tensor([[17, 33, 41, 9]])
    mask = (ids != 0).long()
    native_cache = _cache(cache, model)
    native = _steps(model, ids, mask, native_cache)
    assert step.calls == 5 and step.last_reason is None
    # a plain DynamicCache: every step one native call over all layers (LayerChain)
    assert step.chained == (5 if cache == "dynamic" else 0)
    layer_calls = [f.calls for f in get_report(model).blocks.values()]
    monkeypatch.setattr(step, "_why_static", "off in this test")
    hf_cache = _cache(cache, model)
    hf_loop = _steps(model, ids, mask, hf_cache)
    assert step.calls == 5 and step.last_reason == "off in this test"
    # the HF loop ran the same native layers (their own counters), and gave the same logits
    assert all(f.calls > c for f, c in zip(get_report(model).blocks.values(), layer_calls))
    assert torch.equal(native, hf_loop)
    for ours, theirs in zip(native_cache.layers, hf_cache.layers):  # the same cache, too
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def _crop_steps(model, ids):
    """Greedy steps with a crop of the last 2 tokens in between (as assisted decoding does):
    the chain then writes into the same buffers from the shorter length."""
    cache = DynamicCache(config=model.config)
    out = _steps(model, ids, torch.ones_like(ids), cache, steps=4)
    cache.crop(-2)
    n = cache.get_seq_length()
    with torch.inference_mode():
        tok = out[1].argmax(-1, keepdim=True)
        mask = torch.ones(1, n + 1, dtype=torch.long)
        logits = model(tok, attention_mask=mask, past_key_values=cache, use_cache=True).logits
    return out, logits, cache


@pytest.mark.parametrize("quant", [None, {"bits": 4, "group_size": 32}])
def test_chained_steps_equal_the_layer_loop(quant, monkeypatch):
    """Chained steps against the per-layer native loop: greedy generate, a crop, and beams
    (batched rows, which do not chain) in between, with the same tokens, logits and cache."""
    from hf_dsinfer.injection import decode_step

    model = _model(quant)
    step = get_report(model).step
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        chained = [model.generate(ids, **kw), model.generate(ids, num_beams=3, **kw)]
    chained_crop = _crop_steps(model, ids)
    assert step.chained == 5 + 5  # greedy generate, then 4 steps and one after the crop
    monkeypatch.setattr(decode_step, "kv_rooms", lambda *a: None)  # the per-layer loop
    calls = step.calls
    with torch.inference_mode():
        loop = [model.generate(ids, **kw), model.generate(ids, num_beams=3, **kw)]
    loop_crop = _crop_steps(model, ids)
    assert step.chained == 10 and step.calls > calls
    assert all(torch.equal(a, b) for a, b in zip(chained, loop))
    assert torch.equal(chained_crop[0], loop_crop[0])
    assert torch.equal(chained_crop[1], loop_crop[1])
    for ours, theirs in zip(chained_crop[2].layers, loop_crop[2].layers):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_layer_chain_refuses_a_cache_buffer_it_cannot_write():
    """LayerChain.step checks every buffer before the one native call: a buffer without room
    for the token, or of the wrong head count, is a ValueError naming what it expected."""
    from hf_dsinfer.kernels.decode import LayerChain

    model = _model()
    layers = [f.decode_ready() for f in get_report(model).blocks.values()]
    chain = LayerChain(layers)
    x = torch.zeros(1, 1, _BASE["hidden_size"], dtype=torch.bfloat16)
    d = _BASE["hidden_size"] // _BASE["num_attention_heads"]
    cos, sin = torch.ones(d, dtype=torch.bfloat16), torch.zeros(d, dtype=torch.bfloat16)
    full = [(torch.zeros(1, 2, 4, d, dtype=torch.bfloat16),) * 2 for _ in layers]
    with pytest.raises(ValueError, match=r"expected bf16 CPU \[1, 2, >4"):
        chain.step(x, cos, sin, full, 4, None)  # no room for token 4
    heads = [(torch.zeros(1, 3, 8, d, dtype=torch.bfloat16),) * 2 for _ in layers]
    with pytest.raises(ValueError, match="expected bf16 CPU"):
        chain.step(x, cos, sin, heads, 4, None)
    room = [(torch.zeros(1, 2, 8, d, dtype=torch.bfloat16),
             torch.zeros(1, 2, 8, d, dtype=torch.bfloat16)) for _ in layers]
    with pytest.raises(ValueError, match="keep must be 5"):
        chain.step(x, cos, sin, room, 4, torch.ones(4, dtype=torch.uint8))
    out = chain.step(x, cos, sin, room, 4, None)  # a valid call writes token 4 of each layer
    assert out.shape == x.shape and all(layer.calls > 0 for layer in layers)


@pytest.mark.amx
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


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("quant", [None, {"bits": 4, "group_size": 32}])
@pytest.mark.parametrize("padded", [False, True])
def test_opt_step_equals_hf_layer_loop(cache, quant, padded, monkeypatch):
    """OPT's decoder as the step: embeddings plus learned positions (from the mask's cumsum, so
    left padding shifts them), the layers, final_layer_norm; the same logits and cache as
    OPTDecoder.forward running the same native layers."""
    from tests.kernels.test_native_decode import _opt

    model = hf_dsinfer.init_inference(_opt(), dtype=torch.bfloat16, quant=quant)
    _step_against_hf_loop(model, cache, padded, monkeypatch)


def test_post_ln_opt_keeps_hf_loop():
    """OPT-350m's post-LN blocks have no native layer: no step is installed."""
    from tests.kernels.test_native_decode import _opt

    model = hf_dsinfer.init_inference(_opt(do_layer_norm_before=False), dtype=torch.bfloat16)
    assert get_report(model).step is None


def test_int4_batches_take_the_batched_layer_where_it_runs():
    """int4 batches: the batched native layer where it takes int4 weights (without AMX, where
    the tier's int4 kernels run), else HF's forward with the reason."""
    model = _model({"bits": 4, "group_size": 32})
    report = get_report(model)
    step = report.step
    ids = torch.tensor([[12, 17, 33], [0, 17, 33]])
    _steps(model, ids, (ids != 0).long(), DynamicCache(config=model.config), steps=2)
    layers = [block.decode_layer() for block in report.blocks.values()]
    if all(layer is not None and layer.rows_why is None for layer in layers):
        assert step.calls == 2 and step.last_reason is None
    else:
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
    assert step.chained == 10  # a cache made under inference_mode is rebuilt under no_grad
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
        from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

        class Count(ModelHook):
            def pre_forward(self, module, *args, **kwargs):
                seen.append(2)
                return args, kwargs

        add_hook_to_module(model.model.layers[0], Count())  # accelerate's (offload, devices)
        model(tok, past_key_values=cache, use_cache=True)
        assert seen == [1, 2] and step.last_reason == "hooks on a decoder layer"
        remove_hook_from_module(model.model.layers[0])
        model(torch.tensor([[5, 6]]), past_key_values=cache, use_cache=True)
        assert step.last_reason == "not one token of 1-256 sequences on the CPU"
        float_mask = torch.zeros(1, cache.get_seq_length() + 1)
        lookups = []
        handle = model.model.embed_tokens.register_forward_hook(lambda m, a, o: lookups.append(1))
        before = model.model.layers[0].forward.calls
        model(tok, attention_mask=float_mask, past_key_values=cache, use_cache=True)
        assert step.last_reason == "an attention mask other than padding"
        assert lookups == [1]  # refused after embedding: HF's forward reused the embeddings
        handle.remove()
        assert model.model.layers[0].forward.calls > before  # HF's loop ran the blocks
        with monkeypatch.context() as m:
            switch(m, native=False)
            model(tok, past_key_values=cache, use_cache=True)
            assert step.last_reason.startswith("native kernels unavailable")
        assert step.calls == 0
        model(tok, past_key_values=cache, use_cache=True)  # and back, the layers not marked failed
        assert step.calls == 1 and step.last_reason is None
    with torch.enable_grad():
        model(tok, past_key_values=cache, use_cache=True)
    assert step.last_reason == "grad, training or torch.compile tracing"


@pytest.mark.parametrize("config", [MistralConfig, Phi3Config])
def test_sliding_window_models_take_the_layer_loop(config, monkeypatch):
    """Mistral / Phi-3 with a window (every layer slides, no layer types): the step's layer
    loop, each layer over the keys its DynamicSlidingWindowLayer returns; past the window, the
    same logits and cache as HF's layer loop calling the same native layers."""
    model = _model(config=config(**_BASE, sliding_window=6))
    step = get_report(model).step
    assert step.reason() is None and step.windows == [6, 6]
    assert "its layers called one by one" in hf_dsinfer.explain(model)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 10]])
    mask = (ids != 0).long()
    native_cache = _cache("dynamic", model)
    native = _steps(model, ids, mask, native_cache)
    assert step.calls == 5 and step.chained == 0 and step.last_reason is None
    monkeypatch.setattr(step, "_why_static", "off in this test")
    hf_cache = _cache("dynamic", model)
    hf_loop = _steps(model, ids, mask, hf_cache)
    assert torch.equal(native, hf_loop)
    for ours, theirs in zip(native_cache.layers, hf_cache.layers):
        assert ours.keys.shape[2] == 5  # window - 1 kept
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
