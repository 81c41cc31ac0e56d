"""W4A8 models (quant={"bits": 4, "act_bits": 8}) end to end: every quantized linear of the fused
blocks (MoE experts included) runs kernels/quant.py's 8-bit-activation path, counted; the CPU
kernel and the torch reference give the same tokens; continuous batching gives every request
the tokens per-prompt generate gives it (a row's numbers do not depend on the rows packed beside
it); the native batch-1 decode layer steps aside and explain says why; the setting survives
save and reload; bad settings are refused with a fix."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

import hf_dsinfer
from hf_dsinfer.config import DSInferConfig
from hf_dsinfer.errors import DSInferConfigError
from hf_dsinfer.injection.quantize import QuantizedLinear
from hf_dsinfer.injection.walker import get_report
from hf_dsinfer.kernels import quant as Q
from tests.kernels.conftest import count_calls
from tests.tiny_models import VOCAB, make_model

A8 = {"bits": 4, "group_size": 32, "act_bits": 8}
NEW = 6

pytestmark = pytest.mark.usefixtures("quiet_eos_warning")


def _prompts():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 17, 9, 40)]


def _config():
    return GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1, pad_token_id=0)


def _each(model, prompts):
    return [model.generate(torch.tensor([p]), generation_config=_config())[0, len(p):].tolist()
            for p in prompts]


def _batch(model, prompts):
    cb = ContinuousBatchingConfig(max_batch_tokens=32, num_blocks=64, page_size=8)
    out = model.generate_batch(prompts, generation_config=_config(),
                               continuous_batching_config=cb, warmup=False)
    return [r.generated_tokens for r in out.values()]


def _a8_linears(model):
    """The 4-bit linears (the output head, where quantized, is int8 with bf16 activations)."""
    return [m for m in model.modules() if isinstance(m, QuantizedLinear) and m.bits == 4]


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_every_quantized_linear_runs_a8_and_batching_matches_generate(monkeypatch, family):
    ref = make_model(family)
    model = hf_dsinfer.init_inference(copy.deepcopy(ref), quant=A8)
    linears = _a8_linears(model)
    assert linears and all(m.quantized.act_bits == 8 for m in linears)
    calls = count_calls(monkeypatch, Q, "linear_int4_a8_cpu")
    prompts = _prompts()
    with torch.inference_mode():
        each = _each(model, prompts)
    n_each = len(calls)
    assert n_each > 0
    with torch.no_grad():
        batch = _batch(model, prompts)
    assert len(calls) > n_each
    assert batch == each
    assert all(len(t) == NEW for t in batch)


def test_cpu_kernel_and_reference_agree():
    ref = make_model("llama")
    fast = hf_dsinfer.init_inference(copy.deepcopy(ref), quant=A8)
    slow = hf_dsinfer.init_inference(copy.deepcopy(ref), quant=A8, kernels="ref")
    ids = torch.tensor([_prompts()[1]])
    with torch.no_grad():
        a, b = fast(ids).logits, slow(ids).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert _each(fast, _prompts()[:2]) == _each(slow, _prompts()[:2])


def test_a8_is_close_to_bf16_activations_not_equal():
    """Other numbers than the int4 model with bf16 activations, by design, but close."""
    ref = make_model("llama")
    a8 = hf_dsinfer.init_inference(copy.deepcopy(ref), quant=A8)
    a16 = hf_dsinfer.init_inference(copy.deepcopy(ref), quant={"bits": 4, "group_size": 32})
    ids = torch.tensor([_prompts()[3]])
    with torch.no_grad():
        x, y = a8(ids).logits, a16(ids).logits
    assert not torch.equal(x, y)
    assert ((x - y).norm() / y.norm()) < 0.05


@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_native_decode_layer_runs_w4a8_and_explain_says_so(grad_mode, monkeypatch):
    """The native batch-1 decode layer takes W4A8 projections (csrc/cpu_decode.c: a8_dots, the
    panel kernel's bits): counted under both grad modes; its logits are the torch path's (whose
    linears run linear_int4_a8_cpu) within the bound every native layer meets (its norms and
    attention round in another order: tests/kernels/test_native_decode.py), and explain names
    it."""
    from transformers import LlamaConfig

    from hf_dsinfer.kernels import _native
    from hf_dsinfer.kernels.abi import LIN_INT4_A8, LIN_INT4_A8_TILED
    from tests.kernels.test_native_decode import _BASE, _close, _step_logits  # head_dim 32

    if _native.lib("a8") is None or _native.lib() is None:
        pytest.skip(f"no native W4A8 kernels here: {_native.why_unavailable('a8')}")
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(LlamaConfig(**_BASE), dtype=torch.bfloat16).eval()
    model = hf_dsinfer.init_inference(ref, quant=A8)
    text = hf_dsinfer.explain(model)
    assert "weights with 8-bit activations (W4A8" in text  # the quantization summary
    assert "batch-1 decode steps (bf16, CPU): native layer" in text
    assert "1-8 rows native" not in text  # not the W4A16 crossovers
    assert "(hfd_int4_a8_rows)" in text and "(hfd_int4_gemm_a8)" in text
    layers = model.model.layers
    for layer in layers:
        kinds = {lin.kind for lin in layer.forward.decode_layer().struct.lin}
        assert kinds <= {LIN_INT4_A8, LIN_INT4_A8_TILED}, kinds
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with getattr(torch, grad_mode)():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape == (1, 14)
    calls = sum(layer.forward._decode.calls for layer in layers)
    assert calls == 7 * len(layers)  # every one-token step, every layer
    mask = torch.ones_like(ids)
    torch_path = _step_logits(model, ids, mask, False, monkeypatch)
    assert sum(layer.forward._decode.calls for layer in layers) == calls
    native = _step_logits(model, ids, mask, True, monkeypatch)
    assert sum(layer.forward._decode.calls for layer in layers) == calls + 4 * len(layers)
    _close(native, torch_path)


def test_batched_native_layer_runs_w4a8(monkeypatch):
    """Three sequences, two left-padded: the batched native layer's W4A8 projections run the
    torch path's kernel for those rows (hfd_int4_gemm_a8, AMX or not), counted, logits within the
    native layers' bound of the torch path's."""
    from transformers import LlamaConfig

    from hf_dsinfer.kernels import _native
    from tests.kernels.test_native_decode import _BASE, _batched_against_torch_path, _need_batched

    if _native.lib("a8") is None or _native.lib() is None:
        pytest.skip(f"no native W4A8 kernels here: {_native.why_unavailable('a8')}")
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(LlamaConfig(**_BASE), dtype=torch.bfloat16).eval()
    model = hf_dsinfer.init_inference(ref, quant=A8)
    _need_batched(model)
    assert "native W4A8 projections" in hf_dsinfer.explain(model) or _native.amx_available()
    _batched_against_torch_path(model, monkeypatch)


def test_from_pretrained_takes_act_bits(llama_dir):
    """Through transformers' loading (a dict, as a user writes it) and the config it records
    (quantized models are not saved: the config is re-applied at load)."""
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dsinfer={"quant": A8})
    assert get_report(model).config.quant.act_bits == 8
    linears = _a8_linears(model)
    assert linears and all(m.quantized.act_bits == 8 for m in linears)
    again = DSInferConfig.coerce(dataclasses.asdict(get_report(model).config))
    assert again.quant.act_bits == 8


@pytest.mark.parametrize("quant,needle", [
    ({"bits": 8, "act_bits": 8}, "built for 4-bit weights"),
    ({"bits": 4, "act_bits": 4}, "expected 16"),
    ({"bits": 4, "act_bits": True}, "expected 16"),
])
def test_bad_act_bits_are_refused_with_a_fix(quant, needle):
    with pytest.raises(DSInferConfigError, match=needle) as err:
        hf_dsinfer.init_inference(make_model("llama"), quant=quant)
    assert "Fix:" in str(err.value)
