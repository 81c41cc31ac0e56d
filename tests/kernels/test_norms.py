"""norms: references against nn.LayerNorm / LlamaRMSNorm, Triton and CPU paths against them."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hf_dsinfer.kernels import norms
from tests.kernels.conftest import INTERPRET_TOL, assert_close_tol, requires_triton

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BATCH, TOKENS, HIDDEN = 2, 7, 80
EPS = 1e-5
# (residual, x_bias) present?
RESIDUAL_CASES = ((False, False), (True, False), (True, True), (False, True))


def _inputs(dtype, residual=True, x_bias=True, lead=(BATCH, TOKENS)):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*lead, HIDDEN, generator=g).to(dtype)
    res = torch.randn(*lead, HIDDEN, generator=g).to(dtype) if residual else None
    xb = torch.randn(HIDDEN, generator=g).to(dtype) if x_bias else None
    w = (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(dtype)
    b = (0.1 * torch.randn(HIDDEN, generator=g)).to(dtype)
    return x, res, xb, w, b


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_layer_norm_ref_matches_nn_layernorm(dtype):
    x, res, xb, w, b = _inputs(dtype)
    ln = torch.nn.LayerNorm(HIDDEN, eps=EPS).to(dtype)
    with torch.no_grad():
        ln.weight.copy_(w)
        ln.bias.copy_(b)
        expected_h = res + (x + xb)
        out, h = norms.layer_norm_ref(x, w, b, EPS, res, xb)
        assert torch.equal(h, expected_h)
        assert torch.equal(out, ln(expected_h))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_rms_norm_ref_matches_llama(dtype):
    x, res, xb, w, _ = _inputs(dtype)
    hf = LlamaRMSNorm(HIDDEN, eps=EPS).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(w)
        out, h = norms.rms_norm_ref(x, w, EPS, res, xb)
        assert torch.equal(h, res + (x + xb))
        assert torch.equal(out, hf(h))


def test_no_residual_returns_x_itself():
    x, _, _, w, b = _inputs(torch.float32, residual=False, x_bias=False)
    for backend in ("ref", "cpu"):
        assert norms.layer_norm(x, w, b, EPS, backend=backend)[1] is x
        assert norms.rms_norm(x, w, EPS, backend=backend)[1] is x


@requires_triton()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual,x_bias", RESIDUAL_CASES)
def test_layer_norm_triton(dtype, residual, x_bias):
    x, res, xb, w, b = _inputs(dtype, residual, x_bias)
    out, h = norms.layer_norm(x, w, b, EPS, res, xb, backend="triton")
    ref_out, ref_h = norms.layer_norm_ref(x, w, b, EPS, res, xb)
    assert_close_tol(h, ref_h, table=INTERPRET_TOL)
    assert_close_tol(out, ref_out, table=INTERPRET_TOL)


@requires_triton()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual,x_bias", RESIDUAL_CASES)
def test_rms_norm_triton(dtype, residual, x_bias):
    x, res, xb, w, _ = _inputs(dtype, residual, x_bias)
    out, h = norms.rms_norm(x, w, EPS, res, xb, backend="triton")
    ref_out, ref_h = norms.rms_norm_ref(x, w, EPS, res, xb)
    assert_close_tol(h, ref_h, table=INTERPRET_TOL)
    assert_close_tol(out, ref_out, table=INTERPRET_TOL)


@requires_triton()
def test_triton_no_bias_2d_input_and_fp32_weight():
    # LayerNorm without bias; x with a single leading dim; RMSNorm with an fp32 weight on bf16
    # activations promotes the output to fp32, as HF's `weight * h.to(input_dtype)` does.
    x, res, _, w, _ = _inputs(torch.bfloat16, lead=(5,), x_bias=False)
    assert_close_tol(norms.layer_norm(x, w, None, EPS, res, backend="triton")[0],
                     norms.layer_norm_ref(x, w, None, EPS, res)[0], table=INTERPRET_TOL)
    w32 = w.float()
    out = norms.rms_norm(x, w32, EPS, res, backend="triton")[0]
    ref = norms.rms_norm_ref(x, w32, EPS, res)[0]
    assert out.dtype == ref.dtype == torch.float32
    assert_close_tol(out, ref, torch.bfloat16, table=INTERPRET_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual,x_bias", ((False, False), (True, True)))
def test_rms_norm_cpu_is_bit_exact(dtype, residual, x_bias):
    x, res, xb, w, _ = _inputs(dtype, residual, x_bias)
    out, h = norms.rms_norm_cpu(x, w, EPS, res, xb)
    ref_out, ref_h = norms.rms_norm_ref(x, w, EPS, res, xb)
    assert torch.equal(h, ref_h)
    assert torch.equal(out, ref_out)


def test_auto_on_cpu_runs_the_cpu_fast_path(monkeypatch):
    calls = []
    real = norms.rms_norm_cpu
    monkeypatch.setattr(norms, "rms_norm_cpu", lambda *a: calls.append(1) or real(*a))
    x, res, xb, w, _ = _inputs(torch.float32)
    norms.rms_norm(x, w, EPS, res, xb, backend="auto")
    assert calls == [1]


# -- the other families' RMSNorms: OLMo 2 (weight multiply in fp32), Gemma 2/3 ((1 + w) in fp32)
def _hf_norm(style: str, dtype: torch.dtype, w: torch.Tensor) -> torch.nn.Module:
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    module = (Olmo2RMSNorm if style == "fp32" else Gemma2RMSNorm)(HIDDEN, eps=EPS).to(dtype)
    with torch.no_grad():
        module.weight.copy_(w - 1 if style == "gemma" else w)  # Gemma stores w - 1
    return module


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("style", ("fp32", "gemma"))
def test_rms_norm_styles_match_hf(dtype, style):
    x, res, xb, w, _ = _inputs(dtype)
    hf = _hf_norm(style, dtype, w)
    with torch.no_grad():
        out, h = norms.rms_norm_ref(x, hf.weight, EPS, res, xb, style=style)
        assert torch.equal(h, res + (x + xb))
        assert out.dtype == dtype
        assert torch.equal(out, hf(h))
        cpu_out, _ = norms.rms_norm(x, hf.weight, EPS, res, xb, backend="cpu", style=style)
        assert_close_tol(cpu_out, out, dtype)
        if dtype == torch.bfloat16:  # the weight multiply in fp32 is what tells them apart
            llama, _ = norms.rms_norm_ref(x, hf.weight, EPS, res, xb)
            assert not torch.equal(llama, out)


@requires_triton()
@pytest.mark.parametrize("style", ("fp32", "gemma"))
def test_rms_norm_styles_triton(style):
    x, res, xb, w, _ = _inputs(torch.bfloat16)
    out, h = norms.rms_norm(x, w, EPS, res, xb, backend="triton", style=style)
    ref_out, ref_h = norms.rms_norm_ref(x, w, EPS, res, xb, style=style)
    assert out.dtype == ref_out.dtype == torch.bfloat16
    assert_close_tol(h, ref_h, table=INTERPRET_TOL)
    assert_close_tol(out, ref_out, table=INTERPRET_TOL)


def test_rms_norm_unknown_style_raises():
    x, _, _, w, _ = _inputs(torch.float32, residual=False, x_bias=False)
    with pytest.raises(ValueError, match="style"):
        norms.rms_norm(x, w, EPS, backend="cpu", style="t5")
