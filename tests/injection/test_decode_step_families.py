"""The one-call decode step (injection/decode_step.py) for the 2026 Llama-pattern families
(issue 27): Qwen3, Phi-3 (partial rotary), OLMo 2 (fp32 cos / sin), SmolLM3 (NoPE layers),
Gemma (its embedding scales itself), Granite (embedding multiplier), Seed-OSS (biases on
q / k / v and the MLP, none on o_proj), ERNIE 4.5 (fp32 pairs RoPE), GLM (bf16 pairs over half
of each head), HunYuan (q / k norms after RoPE), Arcee (squared-ReLU MLP), StarCoder2 (tanh-GELU
MLP, LayerNorms, biases everywhere), StableLM (LayerNorms, partial rotary), Jais 2 (LayerNorms,
biases, squared ReLU) and HyperCLOVA X (Granite's multipliers after post-norms); Ministral's,
EXAONE 4's and Code World Model's sliding / full layers (EXAONE's full ones NoPE) as
Gemma 2 / 3's.

For each, the step must really run (its counters and the blocks' path record), and give
exactly what HF's own layer loop gives with the same native layers (same kernels: the same
bits, logits and cache); greedy tokens equal; fp32 models keep HF eager's tokens. Gemma 2 / 3
(sliding / global layers) take the step's layer loop, past their window too; a static cache
(whose sliding layers roll their keys) keeps the per-block path, and explain says why."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    ArceeConfig,
    AutoModelForCausalLM,
    CwmConfig,
    Ernie4_5Config,
    Exaone4Config,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    GlmConfig,
    GraniteConfig,
    HunYuanDenseV1Config,
    HyperCLOVAXConfig,
    Jais2Config,
    MinistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen3Config,
    SeedOssConfig,
    SmolLM3Config,
    StableLmConfig,
    Starcoder2Config,
    VaultGemmaConfig,
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
    "seed_oss": lambda: SeedOssConfig(**_BASE, attention_bias=True, attention_out_bias=False,
                                      mlp_bias=True),
    "ernie4_5": lambda: Ernie4_5Config(**_BASE, use_bias=True),  # fp32 cos / sin, pairs
    "glm": lambda: GlmConfig(**_BASE, head_dim=32, attention_bias=True,
                             partial_rotary_factor=0.5),  # bf16 pairs over 16 of 32 dims
    "hunyuan_v1_dense": lambda: HunYuanDenseV1Config(**_BASE, head_dim=32),
    "arcee": lambda: ArceeConfig(**_BASE, head_dim=32),
    "starcoder2": lambda: Starcoder2Config(**_BASE, head_dim=32, use_bias=True,
                                           sliding_window=None),
    # 64-wide heads (StableLM's head_dim is hidden / heads), 32 dims rotated
    "stablelm": lambda: StableLmConfig(**{**_BASE, "num_attention_heads": 2,
                                          "num_key_value_heads": 1}, partial_rotary_factor=0.5,
                                       use_qkv_bias=True),
    # Jais 2: LayerNorms, biases, squared ReLU; HyperCLOVA X: Granite's multipliers with
    # Peri-LN (post-norms before the residual multiplier)
    "jais2": lambda: Jais2Config(**_BASE, head_dim=32, attention_bias=True, mlp_bias=True),
    "hyperclovax": lambda: HyperCLOVAXConfig(**_BASE, residual_multiplier=0.4,
                                             attention_multiplier=0.1, embedding_multiplier=2.0,
                                             logits_scaling=0.5, use_post_norm=True),
}
INNER = {"qwen3": "Qwen3Model", "phi3": "Phi3Model", "olmo2": "Olmo2Model",
         "smollm3": "SmolLM3Model", "gemma": "GemmaModel", "granite": "GraniteModel",
         "seed_oss": "SeedOssModel", "ernie4_5": "Ernie4_5Model", "glm": "GlmModel",
         "hunyuan_v1_dense": "HunYuanDenseV1Model", "arcee": "ArceeModel",
         "starcoder2": "Starcoder2Model", "stablelm": "StableLmModel", "jais2": "Jais2Model",
         "hyperclovax": "HyperCLOVAXModel"}


def _hf(name: str, dtype=torch.bfloat16, seed: int = 0, config=None):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config or CONFIGS[name](), dtype=dtype).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # HF inits every RMSNorm alike: distinct weights make each count
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                noise = 0.3 * torch.randn(module.weight.shape, generator=gen)
                module.weight.add_(noise.to(module.weight.dtype))
            elif isinstance(module, torch.nn.LayerNorm):  # weight 1, bias 0 from HF
                for t in (module.weight, module.bias):
                    if t is not None:
                        t.add_((0.3 * torch.randn(t.shape, generator=gen)).to(t.dtype))
            elif isinstance(module, torch.nn.Linear) and module.bias is not None:
                noise = 0.1 * torch.randn(module.bias.shape, generator=gen)  # HF's are zeros
                module.bias.add_(noise.to(module.bias.dtype))
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


SLIDING = {  # window 6: a 6-token prompt and 5 steps run past it
    "Gemma2Model": lambda: Gemma2Config(**{**_BASE, "num_hidden_layers": 2}, head_dim=32,
                                        sliding_window=6, query_pre_attn_scalar=24),
    "Gemma3TextModel": lambda: Gemma3TextConfig(
        **_BASE, head_dim=32, sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
    "VaultGemmaModel": lambda: VaultGemmaConfig(**{**_BASE, "num_hidden_layers": 2}, head_dim=32,
                                                sliding_window=6, query_pre_attn_scalar=24),
    "MinistralModel": lambda: MinistralConfig(
        **_BASE, head_dim=32, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"]),
    # sliding_window on every attention, applied where is_sliding; the full layer is NoPE
    "Exaone4Model": lambda: Exaone4Config(
        **_BASE, head_dim=32, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"]),
    # Code World Model: Ministral's forward, Llama's block
    "CwmModel": lambda: CwmConfig(**_BASE, head_dim=32, sliding_window=6,
                                  layer_types=["sliding_attention", "full_attention"],
                                  rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
}


@pytest.mark.parametrize("inner", list(SLIDING))
@pytest.mark.parametrize("padded", [False, True])
def test_sliding_layers_take_the_step(inner, padded, monkeypatch):
    """Sliding / global layers: 5 steps through the step's layer loop (each sliding layer over
    the keys its DynamicSlidingWindowLayer returns, Gemma 3 with a rotary embedding per layer
    type), then through HF's layer loop calling the same native layers: the same logits and
    cache, with the keys past the window dropped."""
    model = hf_dsinfer.init_inference(_hf("", config=SLIDING[inner]()), dtype=torch.bfloat16)
    assert type(model.model).__name__ == inner
    step = get_report(model).step
    assert step.reason() is None and step.windows == [6, None]
    assert "one loop over them per step" in hf_dsinfer.explain(model)
    blocks = list(get_report(model).blocks.values())
    ids = (torch.tensor([[0, 0, 17, 33, 41, 9, 5, 12]]) if padded
           else torch.tensor([[17, 33, 41, 9, 5, 12]]))
    mask = (ids != 0).long()
    native_cache = _cache("dynamic", model)
    assert type(native_cache.layers[0]).__name__ == "DynamicSlidingWindowLayer"
    native = _steps(model, ids, mask, native_cache)
    assert step.calls == 5 and step.chained == 0 and step.last_reason is None
    assert all(f.paths.counts.get("step_loop", 0) == 5 for f in blocks)
    assert native_cache.layers[0].keys.shape[2] == 5  # window - 1 kept
    monkeypatch.setattr(step, "_why_static", "off in this test")
    hf_cache = _cache("dynamic", model)
    hf_loop = _steps(model, ids, mask, hf_cache)
    assert step.calls == 5 and all(f.paths.counts.get("native", 0) >= 5 for f in blocks)
    assert torch.equal(native, hf_loop)
    for ours, theirs in zip(native_cache.layers, hf_cache.layers):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


@pytest.mark.parametrize("inner", list(SLIDING))
def test_sliding_greedy_and_padded_batch_equal_the_per_block_path(inner, monkeypatch):
    """generate: greedy tokens of one prompt past the window, and of a left-padded batch
    where the batched layer runs, equal the per-block path's."""
    model = hf_dsinfer.init_inference(_hf("", config=SLIDING[inner]()), dtype=torch.bfloat16)
    step = get_report(model).step
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0,
              "disable_compile": True}
    one = torch.tensor([[17, 33, 41, 9, 5]])
    batch = torch.tensor([[12, 17, 33, 41, 9], [0, 0, 17, 33, 4], [0, 0, 0, 8, 9]])
    mask = (batch != 0).long()
    with torch.inference_mode():
        native = model.generate(one, **kwargs)
        assert step.calls == 7 and step.last_reason is None
        native_batch = model.generate(batch, attention_mask=mask, **kwargs)
        batched = step.calls - 7
        monkeypatch.setattr(step, "_why_static", "off in this test")
        per_block = model.generate(one, **kwargs)
        per_block_batch = model.generate(batch, attention_mask=mask, **kwargs)
    assert torch.equal(native, per_block)
    assert torch.equal(native_batch, per_block_batch)
    layer = next(iter(get_report(model).blocks.values())).decode_ready(False, 32)
    if layer is not None and layer.rows_why is None and layer.rows_max >= 3:
        assert batched == 7  # the batched layer ran each step


@pytest.mark.parametrize("inner", list(SLIDING))
def test_sliding_static_cache_keeps_the_per_block_path(inner):
    """A StaticCache's sliding layers roll their keys in place: the step hands those calls to
    HF's forward, which runs the native layer block by block, with HF's tokens."""
    from transformers import StaticCache

    model = hf_dsinfer.init_inference(_hf("", config=SLIDING[inner]()), dtype=torch.bfloat16)
    step = get_report(model).step
    ids = torch.tensor([[17, 33, 41, 9, 5, 12]])
    cache = StaticCache(config=model.config, max_cache_len=16)
    _steps(model, ids, torch.ones_like(ids), cache)
    assert step.calls == 0 and step.last_reason.startswith("cache layers other than")
    assert all(f.paths.counts.get("native", 0) == 5 for f in get_report(model).blocks.values())
