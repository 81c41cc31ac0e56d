"""torch's private CPU ops are used only after a probe agreed with the project's reference
(kernels/private_ops.py): an op that runs but computes something else (as torch's int4 layout
did when read as another CPU's) is refused once, with its reason, and the callers' reference /
dequantize paths give the right numbers. The wrong ops here are the real ones with their output
columns reversed: same shapes and magnitudes, wrong values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from switches import switch

from hf_dsinfer.kernels import _native, linear, moe, private_ops
from hf_dsinfer.kernels import quant as Q
from hf_dsinfer.kernels.activations import gated_act_ref
from tests.kernels.conftest import REDUCTION_TOL, assert_close_tol, pin_crossovers


@pytest.fixture
def fresh(monkeypatch):
    """No probe run yet in this process (the real ops' verdicts come back afterwards), no
    native kernels (where they run, the callers never reach torch's ops), and torch's packed
    ops bounded past these tests' few rows whatever the running tier measured (the generic
    tier's bound is 1 row: there 3 rows went to dequantize + GEMM and no probe ran)."""
    monkeypatch.setattr(private_ops, "_VERDICTS", {})
    monkeypatch.setattr(_native, "lib", lambda use="kernels": None)
    pin_crossovers(monkeypatch, int8_pack_max_rows=32, int4_pack_max_rows=32)
    return monkeypatch


def _reversed_columns(op):
    """`op` with its output's last dim reversed, and a count of its calls."""
    calls = []

    def wrong(*args):
        calls.append(1)
        return op(*args).flip(-1)

    return wrong, calls


def test_verified_caches_agreement_and_refusal():
    ran = []

    def agree(dtype):
        ran.append(dtype)
        x = torch.arange(6.0).to(dtype)
        return x, x

    def disagree(dtype):
        x = torch.arange(6.0).to(dtype)
        return x * 1.5, x

    def fail(dtype):
        raise RuntimeError("no kernel for this CPU")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(private_ops, "_VERDICTS", {})
        assert private_ops.verified("ok_op", torch.bfloat16, agree)
        assert private_ops.verified("ok_op", torch.bfloat16, agree)
        assert ran == [torch.bfloat16]  # once per process per op and dtype
        with pytest.warns(RuntimeWarning, match="disagrees with the reference"):
            assert not private_ops.verified("bad_op", torch.float32, disagree)
        with pytest.warns(RuntimeWarning, match="no kernel for this CPU"):
            assert not private_ops.verified("failing_op", torch.float32, fail)
        verdicts = private_ops.verdicts()
    assert verdicts[("ok_op", torch.bfloat16)].ok
    assert "relative error 0.5 > 0.0001" in verdicts[("bad_op", torch.float32)].reason


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_wrong_int8pack_mm_is_refused(fresh, dtype):
    wrong, calls = _reversed_columns(torch.ops.aten._weight_int8pack_mm)
    fresh.setattr(torch.ops.aten, "_weight_int8pack_mm", wrong)
    qw = Q.quantize_int8(torch.randn(48, 64).to(dtype))
    x = torch.randn(3, 64).to(dtype)
    with pytest.warns(RuntimeWarning, match="_weight_int8pack_mm.*disagrees"):
        out = Q.linear_int8(x, qw, backend="cpu")
    assert len(calls) == 1  # the probe only
    assert not private_ops.verdicts()[(Q.INT8PACK_MM, dtype)].ok
    assert_close_tol(out, Q.linear_int8_ref(x, qw), dtype, REDUCTION_TOL)


def test_explain_names_a_refused_op(fresh):
    """explain lists refused private ops, and its int8 line names the path that runs."""
    from tiny_models import make_model

    import hf_dsinfer

    switch(fresh, native=False)
    model = hf_dsinfer.init_inference(make_model("llama"), quant={"bits": 8})  # fp32
    assert "private torch ops refused" not in hf_dsinfer.explain(model)
    fresh.setitem(private_ops._VERDICTS, (Q.INT8PACK_MM, torch.float32),
                  private_ops.Verdict(False, "torch's aten._weight_int8pack_mm disagrees"))
    text = hf_dsinfer.explain(model)
    assert "private torch ops refused (their reference paths run): torch's aten." in text
    assert "int8 CPU kernel: dequantize + GEMM (torch's aten._weight_int8pack_mm refused" in text


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_wrong_int4pack_mm_is_refused(fresh, dtype):
    wrong, calls = _reversed_columns(torch.ops.aten._weight_int4pack_mm_for_cpu)
    fresh.setattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", wrong)
    with pytest.warns(RuntimeWarning, match="_weight_int4pack_mm_for_cpu.*disagrees"):
        qw = Q.quantize_int4(torch.randn(48, 128).to(dtype), 32)
    assert qw.cpu_packed is None  # no second copy for a kernel that is not used
    x = torch.randn(3, 128).to(dtype)
    out = Q.linear_int4(x, qw, backend="cpu")
    assert len(calls) == 1
    assert_close_tol(out, Q.linear_int4_ref(x, qw), dtype, REDUCTION_TOL)


def test_int4pack_mm_is_probed_per_input_dtype(fresh):
    """A weight quantized in bf16 keeps torch's copy; fp32 activations ask torch's kernel again,
    and a refusal for fp32 sends them to the dequantize path."""
    qw = Q.quantize_int4(torch.randn(48, 128).to(torch.bfloat16), 32)
    assert qw.cpu_packed is not None
    wrong, calls = _reversed_columns(torch.ops.aten._weight_int4pack_mm_for_cpu)
    fresh.setattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", wrong)
    x = torch.randn(3, 128)
    with pytest.warns(RuntimeWarning, match="float32"):
        out = Q.linear_int4(x, qw, backend="cpu")
    assert len(calls) == 1
    assert_close_tol(out, Q.linear_int4_ref(x, qw), torch.float32, REDUCTION_TOL)


class _WrongLinearPointwise:
    """torch.ops.mkldnn._linear_pointwise (and its .binary overload) with reversed columns."""

    def __init__(self, op):
        self.op = op

    def __call__(self, *args):
        return self.op(*args).flip(-1)

    def binary(self, *args):
        return self.op.binary(*args).flip(-1)


@pytest.mark.skipif(not moe._onednn_bf16(), reason="oneDNN bf16 not available on this CPU")
def test_wrong_linear_pointwise_is_refused(fresh):
    op = torch.ops.mkldnn._linear_pointwise
    fresh.setattr(torch.ops.mkldnn, "_linear_pointwise", _WrongLinearPointwise(op))
    x = torch.randn(40, 64).to(torch.bfloat16)
    gate_up, down = torch.randn(96, 64).to(torch.bfloat16), torch.randn(64, 48).to(torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="_linear_pointwise.*disagrees"):
        assert not moe._onednn_gated(x, gate_up, "silu")
    out = moe._expert_mlp(x, gate_up, down, "silu", kernels=True)
    unfused = gated_act_ref(linear.linear_cpu(x, gate_up), None, "silu")
    assert torch.equal(out, linear.linear_cpu(unfused, down))  # the products, act and * up apart
    assert_close_tol(out, F.linear(F.silu(x @ gate_up[:48].t()) * (x @ gate_up[48:].t()), down),
                     torch.bfloat16, REDUCTION_TOL)
