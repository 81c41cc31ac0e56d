"""The native AMX linear of batched decode (kernels/linear.py -> csrc/cpu_moe.c hfd_linear_bf16).

From 2 to CPU_AMX_MAX_ROWS bf16 rows on a CPU with AMX, `kernels.linear` on CPU must run it
(counted) and give what F.linear gives: fp32 sums of exact bf16 products rounded once, the bias
added before the rounding. Everything else must keep the torch kernels.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from switches import switch
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_dsinfer
from hf_dsinfer.kernels import _native
from hf_dsinfer.kernels import linear as L
from tests.kernels.conftest import count_calls, pin_crossovers

pytestmark = [pytest.mark.skipif(not _native.amx_available(),
               reason="needs the native library and a CPU that grants AMX tiles"),
              pytest.mark.amx, pytest.mark.usefixtures("native_tier")]


def _count(monkeypatch):
    return count_calls(monkeypatch, L, "_native_linear")


def _operands(rows, out, inp, bias, seed=0, lead=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, rows, inp, generator=g).bfloat16()
    w = (torch.randn(out, inp, generator=g) * inp ** -0.5).bfloat16()
    b = torch.randn(out, generator=g).bfloat16() if bias else None
    return x, w, b


# rows: 2 (smallest), 16 (one full panel), 17 and 40 (a partial last panel, an odd number of
# panels), 256 (the limit); out and in cover one and several 32-column tasks, and K up to a
# Llama MLP's 5632
SHAPES = [(2, 64, 64), (16, 256, 2048), (17, 96, 128), (40, 128, 96), (256, 64, 160),
          (3, 32, 5632)]


@pytest.mark.parametrize("bias", (False, True), ids=("no bias", "bias"))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_native_linear_equals_f_linear(monkeypatch, shape, bias):
    calls = _count(monkeypatch)
    x, w, b = _operands(*shape, bias)
    with torch.inference_mode():
        y = L.linear(x, w, b, backend="cpu")
    assert calls == [1]
    ref = F.linear(x, w, b)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    # same accuracy class always; on these shapes also the same bits
    err, ref_err = (y.double() - exact).abs().max(), (ref.double() - exact).abs().max()
    assert err <= 1.5 * ref_err + 1e-6, (err, ref_err)
    assert torch.equal(y, ref)


def test_leading_dims_and_non_contiguous_input(monkeypatch):
    """x [2, 3, K] (6 rows) and a transposed view of x: reshaped / copied, never misread. With
    a bias and a non-contiguous 3-D x, F.linear itself rounds twice (matmul, then add_), so that
    call keeps F.linear; without a bias the view takes the kernel."""
    calls = _count(monkeypatch)
    x, w, b = _operands(3, 64, 96, True, lead=(2,))
    xt = x.transpose(0, 1)  # [3, 2, K], not contiguous
    with torch.no_grad():
        y = L.linear(x, w, b, backend="cpu")
        yt = L.linear(xt, w, None, backend="cpu")
        assert calls == [1, 1]
        ytb = L.linear(xt, w, b, backend="cpu")
    assert calls == [1, 1]
    assert y.shape == (2, 3, 64) and torch.equal(y, F.linear(x, w, b))
    assert torch.equal(yt, F.linear(xt, w)) and torch.equal(ytb, F.linear(xt, w, b))


@pytest.mark.parametrize("case", ["one row", "fp32", "grad", "out not /32", "in not /32",
                                  "too many rows", "transposed weight"])
def test_cases_it_does_not_take_keep_torch_kernels(monkeypatch, case):
    calls = _count(monkeypatch)
    rows, out, inp = {"one row": (1, 64, 64), "out not /32": (4, 48, 64),
                      "in not /32": (4, 64, 40),
                      "too many rows": (L.CPU_AMX_MAX_ROWS + 1, 64, 64)}.get(case, (4, 64, 64))
    x, w, b = _operands(rows, out, inp, bias=True)
    if case == "fp32":
        x, w, b = x.float(), w.float(), b.float()
    if case == "transposed weight":
        w = w.t().contiguous().t()
    if case == "grad":
        w.requires_grad_(True)
        y = L.linear(x, w, b, backend="cpu")
        assert y.requires_grad
    else:
        with torch.no_grad():
            y = L.linear(x, w, b, backend="cpu")
    assert calls == []
    assert torch.allclose(y.float(), F.linear(x, w, b).float())


def test_switched_off_with_the_native_kernels(monkeypatch):
    switch(monkeypatch, native=False)
    calls = _count(monkeypatch)
    x, w, b = _operands(4, 64, 64, True)
    with torch.no_grad():
        L.linear(x, w, b, backend="cpu")
    assert calls == []


def test_batched_generate_runs_it_and_keeps_the_tokens(monkeypatch):
    """A bf16 tiny Llama, batch 3 with left padding: the decoder blocks' linears and the output
    head run the native kernel at prefill (3 x 7 rows); in every decode step (3 rows) the head
    calls it from Python and the blocks from the batched native layer (csrc/cpu_decode.c); greedy
    tokens equal the torch kernels' (HF_DSINFER_NATIVE=0)."""
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = hf_dsinfer.init_inference(
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval(),
        dtype=torch.bfloat16)
    ids = torch.randint(3, 256, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ids[0, :3] = 0
    kwargs = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False,
              "pad_token_id": 0}
    calls = _count(monkeypatch)
    with torch.inference_mode():
        native = model.generate(ids, **kwargs)
        n = len(calls)
        switch(monkeypatch, native=False)
        torch_path = model.generate(ids, **kwargs)
    # prefill: q, k, v, o, gate, up, down per layer, and the output head (3 rows: the last
    # positions); then the head of each of the 5 decode steps
    assert n == 7 * len(model.model.layers) + 1 + 5
    assert len(calls) == n
    layers = [layer.forward._decode for layer in model.model.layers]
    assert all(layer.row_calls >= 5 for layer in layers)  # and the parity check's step
    assert torch.equal(native, torch_path)


def test_explain_names_the_kernel(monkeypatch):
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    bf16 = hf_dsinfer.init_inference(
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval(),
        dtype=torch.bfloat16)
    fp32 = hf_dsinfer.init_inference(AutoModelForCausalLM.from_config(config).eval(),
                                     dtype=torch.float32)
    line = "bf16 linears of 2-256 rows (batched decode, short prompts): native AMX kernel"
    assert line in hf_dsinfer.explain(bf16)
    assert "bf16 linears of" not in hf_dsinfer.explain(fp32)
    switch(monkeypatch, native=False)
    assert ("F.linear (native AMX kernel unavailable: disabled by settings native=False "
            "(HF_DSINFER_NATIVE=0))" in hf_dsinfer.explain(bf16))


# ---- 4-bit weights on AMX tiles (kernels/quant.py: linear_int4_cpu -> csrc/cpu_moe.c:
# hfd_int4_amx) ----

# rows (from int4_native_max_rows + 1: the Xeon's 6), out, in, group, codes: tiles (as the
# model stores them) or row-major (the offload engine's portable codes); partial panels of x
# (17, 40 rows), a Llama MLP's 5632 in features, groups of 32 to 128
INT4_SHAPES = [(9, 64, 128, 32, "tiles"), (16, 256, 2048, 64, "tiles"),
               (17, 96, 512, 128, "rows"), (40, 128, 256, 32, "tiles"),
               (12, 32, 5632, 32, "tiles"), (300, 64, 256, 32, "rows")]


def _int4_operands(rows, out, inp, group, codes, bias, seed=0):
    from hf_dsinfer.kernels import quant as Q

    x, w, b = _operands(rows, out, inp, bias, seed)
    return x, Q.quantize_int4(w, group, portable=codes == "rows"), b


@pytest.mark.parametrize("bias", (False, True), ids=("no bias", "bias"))
@pytest.mark.parametrize("shape", INT4_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_int4_amx_is_f_linear_on_the_dequantized_weight(monkeypatch, shape, bias):
    """The AMX int4 kernel runs (counted) for the rows past the int4 dot-product kernel's and
    computes F.linear on dequantize_int4(W, bf16), rounded to bf16, then the bias added: the
    same bits as oneDNN's AMX GEMM on this CPU for these shapes, within its accuracy always."""
    from hf_dsinfer.kernels import quant as Q

    calls = count_calls(monkeypatch, Q, "_native_int4_amx")
    x, qw, b = _int4_operands(*shape, bias)
    with torch.inference_mode():
        y = Q.linear_int4(x, qw, b, backend="cpu")
    assert len(calls) == 1
    assert qw.tiled == (shape[-1] == "tiles")
    deq = Q.dequantize_int4(qw, torch.bfloat16)
    ref = F.linear(x, deq)
    ref = ref if b is None else ref + b
    exact = F.linear(x.double(), deq.double())
    exact = exact if b is None else exact + b.double()
    err, ref_err = (y.double() - exact).abs().max(), (ref.double() - exact).abs().max()
    assert err <= 1.5 * ref_err + 1e-6, (err, ref_err)
    if shape[0] <= 32:  # oneDNN's AMX GEMM sums in the same order at these rows
        assert torch.equal(y, ref)


@pytest.mark.parametrize("case", ["few rows", "fp32", "out not /32", "past its rows",
                                  "amx off"])
def test_int4_cases_the_amx_kernel_does_not_take(monkeypatch, case):
    """Too few rows (the dot-product kernel's), fp32 x, shapes it does not take, more rows
    than amx_int4_max_rows, AMX switched off: another kernel computes it, the same answer
    class; the AMX kernel returns nothing (declines) or is not asked."""
    from hf_dsinfer.kernels import quant as Q

    rows, out = {"few rows": (2, 64), "out not /32": (12, 48)}.get(case, (12, 64))
    if case == "past its rows":
        pin_crossovers(monkeypatch, amx_int4_max_rows=10)
    if case == "amx off":
        switch(monkeypatch, amx=False)
    took, original = [], Q._native_int4_amx

    def watched(x2, qweight):
        y = original(x2, qweight)
        took.append(y is not None)
        return y

    monkeypatch.setattr(Q, "_native_int4_amx", watched)
    x, qw, b = _int4_operands(rows, out, 128, 32, "tiles", True)
    if case == "fp32":
        x, b = x.float(), b.float()
    with torch.inference_mode():
        y = Q.linear_int4(x, qw, b, backend="cpu")
    deq = Q.dequantize_int4(qw, x.dtype)
    ref = F.linear(x.double(), deq.double(), b.double())
    assert (y.double() - ref).abs().max() <= 0.02 * ref.abs().max()
    assert not any(took)
    # and without that reason, the same call takes it
    if case in ("past its rows", "amx off"):
        pin_crossovers(monkeypatch, amx_int4_max_rows=64)
        switch(monkeypatch, amx=True)
        took.clear()
        with torch.inference_mode():
            Q.linear_int4(x, qw, b, backend="cpu")
        assert took == [True]


def test_explain_names_the_int4_kernels():
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    model = hf_dsinfer.init_inference(
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval(),
        dtype=torch.bfloat16, quant={"bits": 4, "group_size": 32})
    text = hf_dsinfer.explain(model)
    from hf_dsinfer.kernels import crossovers

    bounds = crossovers.rows()
    assert "rows AMX tiles on panels dequantized in cache (kernels/csrc/cpu_moe.c" in text, text
    assert f"-{bounds.amx_int4_max_rows} rows AMX tiles" in text
    assert "more rows dequantize + GEMM" in text
