"""activations: HF name mapping, references against transformers' ACT2FN, Triton against refs."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.bloom.modeling_bloom import BloomGelu

from hf_dsinfer.kernels import activations as acts
from tests.kernels.conftest import DTYPE_TOL, INTERPRET_TOL, assert_close_tol, requires_triton

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BATCH, TOKENS, HIDDEN, INTER = 2, 7, 80, 48
# HF names whose ACT2FN module is exactly the torch op our reference calls.
EXACT_HF_NAMES = ("gelu", "gelu_pytorch_tanh", "relu", "silu", "swish", "relu2")
# HF names that spell tanh-GELU as a formula in the input dtype (a few roundings away).
FORMULA_HF_NAMES = ("gelu_new", "gelu_fast")


def _x(dtype, *shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(*shape, generator=g)).to(dtype)


def test_resolve_activation_names():
    expected = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_fast": "gelu_tanh", "bloom_gelu": "gelu_tanh", "gelu_tanh": "gelu_tanh",
                "relu": "relu", "silu": "silu", "swish": "silu", "relu2": "relu2"}
    assert {name: acts.resolve_activation(name) for name in expected} == expected


def test_resolve_activation_unknown_names_the_fix():
    with pytest.raises(ValueError, match="quick_gelu") as err:
        acts.resolve_activation("quick_gelu")
    assert "gelu_new" in str(err.value) and "Fix" in str(err.value)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("hf_name", EXACT_HF_NAMES)
def test_ref_matches_hf_exactly(dtype, hf_name):
    x, bias = _x(dtype, BATCH, TOKENS, HIDDEN), _x(dtype, HIDDEN, seed=1)
    out = acts.bias_act_ref(x, bias, acts.resolve_activation(hf_name))
    assert torch.equal(out, ACT2FN[hf_name](x + bias))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("hf_name", (*FORMULA_HF_NAMES, "bloom_gelu"))
def test_ref_matches_hf_formula_gelus(dtype, hf_name):
    x = _x(dtype, BATCH, TOKENS, HIDDEN)
    hf = BloomGelu() if hf_name == "bloom_gelu" else ACT2FN[hf_name]
    out = acts.bias_act_ref(x, None, acts.resolve_activation(hf_name))
    # The HF modules evaluate the tanh formula op by op in the input dtype (several roundings);
    # torch evaluates it in fp32 and rounds once. gelu_fast also rounds its constant.
    atol, rtol = DTYPE_TOL[dtype] if dtype != torch.float32 else (1e-4, 1e-4)
    torch.testing.assert_close(out, hf(x), atol=atol, rtol=rtol)


@pytest.mark.parametrize("act", acts.ACTIVATIONS)
def test_gated_ref_is_llama_mlp_math_and_packed_equals_split(act):
    gate, up = _x(torch.float32, TOKENS, INTER), _x(torch.float32, TOKENS, INTER, seed=1)
    hf_name = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu", "silu": "silu",
               "relu2": "relu2"}
    assert torch.equal(acts.gated_act_ref(gate, up, act), ACT2FN[hf_name[act]](gate) * up)
    packed = torch.cat([gate, up], dim=-1)
    # Not bit-equal: torch's vectorized and strided CPU loops differ in the last ulp.
    assert_close_tol(acts.gated_act_ref(packed, None, act), acts.gated_act_ref(gate, up, act))


def test_unknown_activation_and_odd_packed_raise():
    x = _x(torch.float32, TOKENS, 7)
    with pytest.raises(ValueError, match="resolve_activation"):
        acts.bias_act(x, None, "gelu_new")
    with pytest.raises(ValueError, match="even"):
        acts.gated_act(x, None, "silu")


@requires_triton()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", acts.ACTIVATIONS)
def test_bias_act_triton(dtype, act):
    x, bias = _x(dtype, BATCH, TOKENS, HIDDEN), _x(dtype, HIDDEN, seed=1)
    assert_close_tol(acts.bias_act(x, bias, act, backend="triton"),
                     acts.bias_act_ref(x, bias, act), table=INTERPRET_TOL)
    assert_close_tol(acts.bias_act(x, None, act, backend="triton"),
                     acts.bias_act_ref(x, None, act), table=INTERPRET_TOL)


@requires_triton()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", acts.ACTIVATIONS)
def test_gated_act_triton(dtype, act):
    packed = _x(dtype, BATCH, TOKENS, 2 * INTER)
    assert_close_tol(acts.gated_act(packed, None, act, backend="triton"),
                     acts.gated_act_ref(packed, None, act), table=INTERPRET_TOL)
    gate, up = packed[..., :INTER], packed[..., INTER:]  # strided views, not copies
    assert_close_tol(acts.gated_act(gate, up, act, backend="triton"),
                     acts.gated_act_ref(gate, up, act), table=INTERPRET_TOL)


def test_auto_on_cpu_runs_the_reference(monkeypatch):
    # No cpu variant exists (the reference already is torch's fused CPU op): auto -> ref.
    calls = []
    real = acts.gated_act_ref
    monkeypatch.setattr(acts, "gated_act_ref", lambda *a: calls.append(1) or real(*a))
    acts.gated_act(_x(torch.float32, TOKENS, 2 * INTER), None, "silu", backend="auto")
    assert calls == [1]


@pytest.mark.parametrize("act", ["relu", "silu", "gelu", "gelu_tanh", "relu2"])
def test_bias_act_inplace_same_values_fewer_tensors(act):
    """inplace=True (a fused MLP's own fc1 output): the values of the out-of-place op, ReLU and
    SiLU written over x; without it x is left alone; a bias of a wider dtype is not forced in."""
    bias_act, bias_act_ref = acts.bias_act, acts.bias_act_ref
    x = torch.randn(37, 64).bfloat16()
    bias = torch.randn(64).bfloat16()
    ref = bias_act_ref(x, bias, act)
    keep = x.clone()
    assert torch.equal(bias_act(x, bias, act), ref) and torch.equal(x, keep)
    out = bias_act(x, bias, act, inplace=True)
    assert torch.equal(out, ref)
    assert (out.data_ptr() == x.data_ptr()) == (act in ("relu", "silu"))
    wide = torch.randn(64)  # fp32 bias: the result is fp32, x cannot hold it
    y = keep.clone()
    assert torch.equal(bias_act(y, wide, act, inplace=True), bias_act_ref(keep, wide, act))
    assert torch.equal(y, keep)
