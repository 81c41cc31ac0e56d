"""The one-call decode step (injection/decode_step.py) for the 2026 Llama-pattern families
(issue 27): Qwen3, Phi-3 (partial rotary), OLMo 2 (fp32 cos / sin), SmolLM3 (NoPE layers),
Gemma (its embedding scales itself) and Granite (embedding multiplier).

For each, the step must really run (its counters and the blocks' path record), and give
exactly what HF's own layer loop gives with the same native layers (same kernels: the same
bits, logits and cache); greedy tokens equal; fp32 models keep HF eager's tokens. Gemma 2 / 3
(sliding / global layers) keep the per-block path, and explain says why."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    GraniteConfig,
    Olmo2Config,
    Phi3Config,
    Qwen3Config,
    SmolLM3Config,
)

import hf_dsinfer
from hf_dsinfer.injection.walker import get_report
from hf_dsinfer.kernels import _native
from tests.injection.test_decode_step import _cache, _step_against_hf_loop, _steps
from tests.kernels.test_native_decode import _BASE  # head_dim 32, GQA 2

pytestmark = pytest.mark.skipif(not _native.builds(),
                                reason=f"native kernels unavailable: {_native.why_unavailable()}")

CONFIGS = {
    "qwen3": lambda: Qwen3Config(**_BASE, head_dim=32),  # per-head q/k norms
    # 16 of 32 dims rotated: cos / sin narrower than the head
    "phi3": lambda: Phi3Config(**_BASE, partial_rotary_factor=0.5),
    "olmo2": lambda: Olmo2Config(**_BASE),  # fp32 cos / sin, post-norms only
    # layer 1 NoPE: one chain over layers with and without RoPE
    "smollm3": lambda: SmolLM3Config(**_BASE, no_rope_layer_interval=2, initializer_range=0.1),
    "gemma": lambda: GemmaConfig(**_BASE, head_dim=64, hidden_act="gelu_pytorch_tanh"),
    "granite": lambda: GraniteConfig(**_BASE, residual_multiplier=0.4, attention_multiplier=0.1,
                                     embedding_multiplier=2.0, logits_scaling=0.5),
}
INNER = {"qwen3": "Qwen3Model", "phi3": "Phi3Model", "olmo2": "Olmo2Model",
         "smollm3": "SmolLM3Model", "gemma": "GemmaModel", "granite": "GraniteModel"}


def _hf(name: str, dtype=torch.bfloat16, seed: int = 0, config=None):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config or CONFIGS[name](), dtype=dtype).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # HF inits every RMSNorm alike: distinct weights make each count
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                noise = 0.3 * torch.randn(module.weight.shape, generator=gen)
                module.weight.add_(noise.to(module.weight.dtype))
    return model


def _model(name: str):
    return hf_dsinfer.init_inference(_hf(name), dtype=torch.bfloat16)


# a padded DynamicCache for every family; a StaticCache (the loop of layer calls) for the two
# whose cos / sin differ most from Llama's (narrower; fp32)
CASES = [(name, "dynamic", True) for name in CONFIGS] + [(name, "static", False)
                                                         for name in ("phi3", "olmo2")]


@pytest.mark.parametrize(("name", "cache", "padded"), CASES)
def test_step_equals_the_per_block_native_path(name, cache, padded, monkeypatch):
    """5 steps through the one-call step (a DynamicCache: one native call for every layer),
    then through HF's layer loop calling the same native layers: the same logits and cache."""
    model = _model(name)
    assert type(model.model).__name__ == INNER[name]
    before = [f.paths.counts.get("step_chain" if cache == "dynamic" else "step_loop", 0)
              for f in get_report(model).blocks.values()]
    _step_against_hf_loop(model, cache, padded, monkeypatch)
    after = [f.paths.counts.get("step_chain" if cache == "dynamic" else "step_loop", 0)
             for f in get_report(model).blocks.values()]
    assert all(a - b == 5 for a, b in zip(after, before))  # every layer, every step


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_tokens_equal_the_per_block_path(name, monkeypatch):
    model = _model(name)
    step = get_report(model).step
    ids = torch.tensor([[17, 33, 41, 9, 5]])
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0,
              "disable_compile": True}
    with torch.inference_mode():
        native = model.generate(ids, **kwargs)
        assert step.calls == 5 and step.last_reason is None
        monkeypatch.setattr(step, "_why_static", "off in this test")
        per_block = model.generate(ids, **kwargs)
    assert step.calls == 5
    assert torch.equal(native, per_block)


@pytest.mark.amx
@pytest.mark.skipif(not _native.amx_available(), reason="no AMX-BF16: batches take HF's loop")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_padded_batch_step_equals_the_per_block_path(name, monkeypatch):
    """Three sequences, left-padded by 0, 2 and 3 tokens, through the batched layer calls."""
    model = _model(name)
    step = get_report(model).step
    ids = torch.tensor([[12, 17, 33, 41, 9], [0, 0, 17, 33, 4], [0, 0, 0, 8, 9]])
    mask = (ids != 0).long()
    native = _steps(model, ids, mask, _cache("dynamic", model))
    assert step.calls == 5 and step.last_reason is None
    monkeypatch.setattr(step, "_why_static", "off in this test")
    per_block = _steps(model, ids, mask, _cache("dynamic", model))
    assert torch.equal(native, per_block)


@pytest.mark.parametrize("name", ["phi3", "granite"])
def test_fp32_models_keep_hf_eager_tokens(name):
    """fp32: the step hands the call to HF's forward (the native layer is bf16), and tokens and
    logits stay HF eager's."""
    hf = _hf(name, dtype=torch.float32, seed=4)
    ids = torch.tensor([[17, 33, 41, 9, 5]])
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0,
              "disable_compile": True}
    with torch.inference_mode():
        want, want_logits = hf.generate(ids, **kwargs), hf(ids).logits
        model = hf_dsinfer.init_inference(hf, dtype=torch.float32)
        step = get_report(model).step
        got = model.generate(ids, **kwargs)
        assert step.calls == 0 and step.last_reason == "not bf16, or positions of another shape"
        logits = model(ids).logits
    assert torch.equal(got, want)
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)


def test_gemma2_and_gemma3_keep_the_per_block_path():
    """Sliding / global layers: the step refuses (explain says why), each block still runs the
    native layer."""
    configs = {
        "Gemma2Model": Gemma2Config(**{**_BASE, "num_hidden_layers": 2}, head_dim=32,
                                    sliding_window=6, query_pre_attn_scalar=24),
        "Gemma3TextModel": Gemma3TextConfig(**_BASE, head_dim=32, sliding_window=6,
                                            layer_types=["sliding_attention", "full_attention"]),
    }
    for inner, config in configs.items():
        model = hf_dsinfer.init_inference(_hf("", config=config), dtype=torch.bfloat16)
        step = get_report(model).step
        assert step.reason().startswith(f"{inner}: sliding / global layers")
        assert f"each called by HF's layer loop ({inner}: sliding" in hf_dsinfer.explain(model)
        with torch.inference_mode():
            model.generate(torch.tensor([[17, 33, 41]]), max_new_tokens=3, do_sample=False,
                           pad_token_id=0, disable_compile=True)
        assert step.calls == 0
        assert all(f.paths.counts.get("native", 0) == 2 for f in get_report(model).blocks.values())
