"""The Triton path on a real CUDA GPU: every kernel against its torch reference at model-sized
shapes (the interpreter runs only tiny ones), and every family fused on the GPU against HF
eager on the same GPU, with the Triton launches counted.

CI has no GPU, so this module skips there (with the reason). On a GPU machine:

    TRITON_INTERPRET=0 python -m pytest -q tests/gpu

bf16 / fp16 kernels are judged by their error against an fp32 computation of the same inputs:
no worse than the torch reference's own error plus a few roundings. fp32 kernels and fp32
models are held to the tolerances the CPU tests use.
"""

from __future__ import annotations

import copy
import os
from collections import Counter

import pytest
import torch
from tiny_models import FAMILIES, MOE_MODELS, make_model, prompts

import hf_dsinfer
from hf_dsinfer.kernels import (
    _dispatch,
    activations,
    alibi,
    attention,
    kv_quant,
    moe,
    norms,
    rotary,
)
from hf_dsinfer.kernels import linear as lin
from hf_dsinfer.kernels import quant as Q

# tests/conftest.py defaults TRITON_INTERPRET to 1 (CPU tests); Triton reads it at import, so
# a GPU run sets it to 0 on the command line.
cuda_ready = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") == "0"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not cuda_ready,
    reason="needs a CUDA GPU and TRITON_INTERPRET=0 "
           "(run: TRITON_INTERPRET=0 python -m pytest tests/gpu)")]

DEV = "cuda"
HALF = (torch.bfloat16, torch.float16)
DTYPES = (torch.float32, *HALF)
FP32_ATOL = 1e-4
GEN = {"max_new_tokens": 24, "min_new_tokens": 24, "pad_token_id": 0, "do_sample": False}


@pytest.fixture(autouse=True)
def _no_tf32():
    """HF eager's fp32 matmuls in IEEE fp32, as on CPU (TF32 would move HF, not us)."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture
def triton_calls(monkeypatch) -> Counter:
    """Which Triton launchers the dispatcher handed out during the test (the proof the GPU
    path ran, not only that its output matched)."""
    calls: Counter = Counter()
    original = _dispatch.pick

    def counted(backend, device, ref, triton_fn=None, cpu_fn=None):
        fn = original(backend, device, ref, triton_fn, cpu_fn)
        if triton_fn is not None and fn is triton_fn:
            calls[fn.__name__] += 1
        return fn

    monkeypatch.setattr(_dispatch, "pick", counted)
    return calls


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)


def _max_err(t: torch.Tensor, exact: torch.Tensor) -> float:
    return (t.float() - exact.float()).abs().max().item()


def _no_worse_than_ref(out, ref, exact, dtype, ulps: float = 2.0):
    """out's error against the fp32 result at most the reference's plus `ulps` roundings of
    the result's scale (fp32: the reference tolerance)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not (out.isnan() & ~ref.isnan()).any()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        return
    eps = 2**-8 if dtype == torch.bfloat16 else 2**-11
    bound = _max_err(ref, exact) + ulps * eps * exact.abs().max().item()
    assert _max_err(out, exact) <= bound, (_max_err(out, exact), _max_err(ref, exact), bound)


# ------------------------------------------------------------------------------------------
# Kernels at model shapes
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ("llama", "gemma"))
@pytest.mark.parametrize("hidden", (896, 4096))
def test_rms_norm(triton_calls, dtype, style, hidden):
    x, res = _randn(7, 33, hidden, dtype=dtype), _randn(7, 33, hidden, dtype=dtype, seed=1)
    w = _randn(hidden, dtype=dtype, seed=2, scale=0.2) + (0 if style == "gemma" else 1)
    out, h = norms.rms_norm(x, w, 1e-6, res, style=style, backend="triton")
    ref, h_ref = norms.rms_norm_ref(x, w, 1e-6, res, None, style)
    exact, _ = norms.rms_norm_ref(x.float(), w.float(), 1e-6, res.float(), None, style)
    _no_worse_than_ref(out, ref, exact, dtype)
    torch.testing.assert_close(h, h_ref, atol=0, rtol=0)  # one add, rounded once
    assert triton_calls["rms_norm_triton"] == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_with_bias_and_residual(triton_calls, dtype):
    x, res = _randn(5, 17, 2560, dtype=dtype), _randn(5, 17, 2560, dtype=dtype, seed=1)
    w, b = _randn(2560, dtype=dtype, seed=2) + 1, _randn(2560, dtype=dtype, seed=3)
    xb = _randn(2560, dtype=dtype, seed=4)
    out, _ = norms.layer_norm(x, w, b, 1e-5, res, xb, backend="triton")
    ref, _ = norms.layer_norm_ref(x, w, b, 1e-5, res, xb)
    exact, _ = norms.layer_norm_ref(*(t.float() for t in (x, w, b)), 1e-5, res.float(),
                                    xb.float())
    _no_worse_than_ref(out, ref, exact, dtype)
    assert triton_calls["layer_norm_triton"] == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ("silu", "gelu", "gelu_tanh"))
def test_gated_and_bias_act(triton_calls, dtype, act):
    gate, up = _randn(9, 11008, dtype=dtype), _randn(9, 11008, dtype=dtype, seed=1)
    out = activations.gated_act(gate, up, act, backend="triton")
    ref = activations.gated_act_ref(gate, up, act)
    _no_worse_than_ref(out, ref, activations.gated_act_ref(gate.float(), up.float(), act), dtype)
    bias = _randn(11008, dtype=dtype, seed=2)
    out = activations.bias_act(gate, bias, act, backend="triton")
    ref = activations.bias_act_ref(gate, bias, act, False)
    _no_worse_than_ref(out, ref, activations.bias_act_ref(gate.float(), bias.float(), act, False),
                       dtype)
    assert triton_calls["gated_act_triton"] == triton_calls["bias_act_triton"] == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", (False, True))
@pytest.mark.parametrize("rot", (128, 64))  # full rotary; partial (Phi-3 / GPT-NeoX style)
def test_rotary(triton_calls, dtype, interleaved, rot):
    q, k = _randn(2, 32, 77, 128, dtype=dtype), _randn(2, 8, 77, 128, dtype=dtype, seed=1)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, device=DEV).float() / rot))
    pos = torch.arange(100, 177, device=DEV).expand(2, -1)
    cos, sin = rotary.rope_cos_sin(inv_freq, pos, interleaved=interleaved, dtype=dtype)
    out = rotary.apply_rotary(q, k, cos, sin, interleaved=interleaved, backend="triton")
    ref = rotary.apply_rotary_ref(q, k, cos, sin, interleaved)
    for a, b in zip(out, ref):  # fp32: the GPU contracts x*cos + y*sin into an FMA
        torch.testing.assert_close(a, b, atol=1e-6 if dtype == torch.float32 else 1e-2,
                                   rtol=1e-5 if dtype == torch.float32 else 1e-2)
    assert triton_calls["apply_rotary_triton"] == 1


ATTN = {  # name -> (batch, Sq, Sk, causal, window, padded, alibi)
    "prefill_512": (2, 512, 512, True, None, True, False),
    "prefill_window": (2, 300, 300, True, 128, False, False),
    "chunk_on_cache": (1, 64, 1024, True, None, False, False),
    "decode_2048": (4, 1, 2048, True, None, True, False),
    "decode_window_alibi": (3, 1, 700, True, 256, True, True),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(ATTN))
def test_attention(triton_calls, dtype, name):
    b, sq, sk, causal, window, padded, with_alibi = ATTN[name]
    q = _randn(b, 32, sq, 128, dtype=dtype)
    k, v = _randn(b, 8, sk, 128, dtype=dtype, seed=1), _randn(b, 8, sk, 128, dtype=dtype, seed=2)
    mask2d = torch.ones(b, sk, dtype=torch.long, device=DEV)
    if padded:
        mask2d[-1, : sk // 3] = 0
    mask = mask2d[:, None, None, :].bool().expand(b, 1, sq, sk)
    bias = alibi.alibi_bias_ref(mask2d, 32, dtype) if with_alibi else None
    kw = {"scale": 128**-0.5, "mask": mask, "causal": causal, "window": window, "bias": bias}
    out = attention.attention(q, k, v, backend="triton", **kw)
    ref = attention.attention_ref(q, k, v, **kw)
    exact = attention.attention_ref(q.float(), k.float(), v.float(),
                                    **{**kw, "bias": None if bias is None else bias.float()})
    valid = mask2d[:, -sq:].bool() if sq > 1 else mask2d.new_ones(b, 1).bool()
    keep = valid[:, None, :, None].expand_as(out)  # rows of padded queries are never read
    out, ref, exact = (torch.where(keep, t.float(), 0) for t in (out, ref, exact))
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    else:
        eps = 2**-8 if dtype == torch.bfloat16 else 2**-11
        assert _max_err(out, exact) <= _max_err(ref, exact) + 4 * eps
    assert triton_calls["attention_triton"] == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", (16, 128))  # DeepSeek-V2-Lite, DeepSeek-V3
def test_mla_absorbed_decode(triton_calls, dtype, heads):
    """MLA's decode form: every query head over one latent KV head, keys latent 512 + rope 64
    wide, values the latent itself (512): value dims differ from key dims."""
    from hf_dsinfer.kernels import mla

    b, sk, r, dr, dn, dv = 2, 700, 512, 64, 128, 128
    q_nope, q_rot = _randn(b, heads, 1, dn, dtype=dtype), _randn(b, heads, 1, dr, dtype=dtype)
    kv, k_rot = _randn(b, 1, sk, r, dtype=dtype, seed=1), _randn(b, 1, sk, dr, dtype=dtype, seed=2)
    w = _randn(heads * (dn + dv), r, dtype=dtype, seed=3, scale=r**-0.5)
    mask = torch.ones(b, 1, 1, sk, dtype=torch.bool, device=DEV)
    mask[1, ..., :100] = False
    kw = {"dv": dv, "scale": (dn + dr) ** -0.5, "mask": mask}
    out = mla.mla_attention_absorbed(q_nope, q_rot, kv, k_rot, w, backend="triton", **kw)
    ref = mla.mla_attention_absorbed(q_nope, q_rot, kv, k_rot, w, backend="ref", **kw)
    exact = mla.mla_attention_expanded(*(t.float() for t in (q_nope, q_rot, kv, k_rot, w)),
                                       backend="ref", **kw)
    _no_worse_than_ref(out, ref, exact, dtype, 4)
    assert triton_calls["attention_triton"] == 1


def test_alibi_bias(triton_calls):
    mask2d = torch.ones(3, 333, dtype=torch.long, device=DEV)
    mask2d[1, :40] = 0
    out = alibi.alibi_bias(mask2d, 32, torch.float32, backend="triton")
    torch.testing.assert_close(out, alibi.alibi_bias_ref(mask2d, 32, torch.float32))
    assert triton_calls["alibi_bias_triton"] == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", (1, 3, 16, 300))  # GEMV (decode) and tiled GEMM (prefill)
@pytest.mark.parametrize("k,n", ((4096, 4096), (2048, 5632), (896, 151936 // 16)))
def test_linear(triton_calls, dtype, rows, k, n):
    x, w = _randn(rows, k, dtype=dtype), _randn(n, k, dtype=dtype, seed=1, scale=k**-0.5)
    bias = _randn(n, dtype=dtype, seed=2)
    out = lin.linear(x, w, bias, backend="triton")
    ref = lin.linear_ref(x, w, bias)
    _no_worse_than_ref(out, ref, lin.linear_ref(x.float(), w.float(), bias.float()), dtype, 4)
    assert triton_calls["linear_triton"] == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", (1, 64))
@pytest.mark.parametrize("bits,group", ((8, None), (4, 128), (4, 32)))
def test_quantized_linear(triton_calls, dtype, rows, bits, group):
    w = _randn(2816, 2048, dtype=dtype, seed=1, scale=2048**-0.5)
    qw = Q.quantize_int8(w) if bits == 8 else Q.quantize_int4(w, group, False)
    x, bias = _randn(rows, 2048, dtype=dtype), _randn(2816, dtype=dtype, seed=2)
    fast, ref = (Q.linear_int8, Q.linear_int8_ref) if bits == 8 else (Q.linear_int4,
                                                                      Q.linear_int4_ref)
    out = fast(x, qw, bias, backend="triton")
    dequant = (Q.dequantize_int8 if bits == 8 else Q.dequantize_int4)(qw, torch.float32)
    exact = lin.linear_ref(x.float(), dequant, bias.float())
    _no_worse_than_ref(out, ref(x, qw, bias), exact, dtype, 4)
    assert sum(triton_calls.values()) == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_quant(triton_calls, dtype):
    x = _randn(2, 8, 333, 128, dtype=dtype)
    q8, r8 = (kv_quant.quantize_kv_int8(x, backend=b) for b in ("triton", "ref"))
    assert (q8.q.int() - r8.q.int()).abs().max().item() <= 1  # a rounding apart at most
    torch.testing.assert_close(q8.scales, r8.scales)
    torch.testing.assert_close(kv_quant.dequantize_kv_int8(q8, dtype, backend="triton"),
                               kv_quant.dequantize_kv_int8(q8, dtype, backend="ref"))
    q4, r4 = (kv_quant.quantize_kv_int4(x, 64, backend=b) for b in ("triton", "ref"))
    for shift in (0, 4):
        lo, lo_ref = ((t.packed >> shift) & 15 for t in (q4, r4))
        assert (lo.int() - lo_ref.int()).abs().max().item() <= 1
    torch.testing.assert_close(q4.scales, r4.scales)
    torch.testing.assert_close(q4.mins, r4.mins)
    torch.testing.assert_close(kv_quant.dequantize_kv_int4(q4, dtype, backend="triton"),
                               kv_quant.dequantize_kv_int4(q4, dtype, backend="ref"))
    assert triton_calls["quantize_kv_int8_triton"] == triton_calls["quantize_kv_int4_triton"] == 1
    assert triton_calls["dequantize_kv_int8_triton"] == triton_calls["dequantize_kv_int4_triton"] == 1


@pytest.mark.parametrize("softmax_first,renormalize", ((True, False), (True, True),
                                                       (False, True)))
def test_topk_gating(triton_calls, softmax_first, renormalize):
    logits = _randn(513, 64)
    w, ids = moe.topk_gating(logits, 6, softmax_first=softmax_first, renormalize=renormalize,
                             backend="triton")
    w_ref, ids_ref = moe.topk_gating_ref(logits, 6, softmax_first, renormalize)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)
    assert triton_calls["topk_gating_triton"] == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", (1, 16, 600))
def test_grouped_expert_mlp(triton_calls, dtype, tokens):
    hidden = _randn(tokens, 1024, dtype=dtype)
    gate_up = _randn(8, 2 * 704, 1024, dtype=dtype, seed=1, scale=0.03)
    down = _randn(8, 1024, 704, dtype=dtype, seed=2, scale=0.04)
    weights, ids = moe.topk_gating_ref(_randn(tokens, 8, seed=3), 2, True, True)
    args = (hidden, gate_up, down, weights, ids)
    out = moe.grouped_expert_mlp(*args, "silu", backend="triton")
    ref = moe.grouped_expert_mlp_ref(*args, "silu")
    exact = moe.grouped_expert_mlp_ref(hidden.float(), gate_up.float(), down.float(), weights,
                                       ids, "silu")
    _no_worse_than_ref(out, ref, exact, dtype, 4)
    assert triton_calls["grouped_expert_mlp_triton"] == 1


# ------------------------------------------------------------------------------------------
# Whole models: fused on the GPU against HF eager on the GPU
# ------------------------------------------------------------------------------------------


def _pair(name, dtype=torch.float32, **kwargs):
    ref = make_model(name, dtype=dtype).to(DEV)
    fused = hf_dsinfer.init_inference(copy.deepcopy(ref), **kwargs)
    return ref, fused


def _calls(model) -> int:
    return sum(hf_dsinfer.fused_call_counts(model).values())


@pytest.mark.parametrize("name", FAMILIES + MOE_MODELS)
def test_family_fp32_logits_and_greedy(triton_calls, name):
    ref, fused = _pair(name)
    assert next(fused.parameters()).device.type == DEV
    ids, mask = (t.to(DEV) for t in prompts(batch=3))
    with torch.no_grad():
        a = ref(ids, attention_mask=mask).logits
        before = _calls(fused)
        b = fused(ids, attention_mask=mask).logits
    assert _calls(fused) > before, "fused blocks did not run"
    valid = mask.bool()
    assert (a - b)[valid].abs().max().item() <= FP32_ATOL
    with torch.inference_mode():
        out_ref = ref.generate(ids, attention_mask=mask, **GEN)
        out = fused.generate(ids, attention_mask=mask, **GEN)
    assert torch.equal(out_ref, out)
    assert sum(triton_calls.values()) > 0, f"no Triton kernel ran: {dict(triton_calls)}"


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3_text", "gpt2", "mixtral_8x2"])
def test_family_bf16_logits(triton_calls, name):
    ref, fused = _pair(name, torch.bfloat16)
    ids, mask = (t.to(DEV) for t in prompts(batch=3))
    with torch.no_grad():
        a = ref(ids, attention_mask=mask).logits.float()
        b = fused(ids, attention_mask=mask).logits.float()
    valid = mask.bool()
    assert (a - b)[valid].abs().max().item() <= 3e-2 * a[valid].abs().max().item()
    assert sum(triton_calls.values()) > 0


@pytest.mark.xfail(torch.__version__ < "2.13", strict=False,
                   reason="transformers' output capturing reads a ContextVar that torch 2.11's "
                          "Dynamo cannot trace (seen on an H200, 2026-11-27; docs/gpu.md)")
def test_compiled_decode_has_no_graph_break(triton_calls):
    """compile=True: the decode step (static cache + CUDA graphs) traces as one graph, and the
    eager steps (prefill) still run Triton."""
    from torch._dynamo.utils import counters

    ref, fused = _pair("llama", compile=True)
    ids, mask = (t.to(DEV) for t in prompts(batch=2))
    with torch.inference_mode():
        expected = ref.generate(ids, attention_mask=mask, **GEN)
        torch._dynamo.reset()
        counters.clear()
        out = fused.generate(ids, attention_mask=mask, **GEN)
    assert torch.equal(out, expected)
    assert not counters["graph_break"], "\n\n".join(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1
    assert triton_calls["rms_norm_triton"] > 0


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3_text"])
def test_quantized_model_matches_hf_on_dequantized_weights(triton_calls, name, bits):
    """bf16 weights quantized on the GPU: the fused model's logits are HF's with the
    dequantized weights (as tests/injection/test_family_quant.py checks on CPU), through the
    Triton int8 / int4 kernels, and it generates."""
    from injection.test_family_quant import BF16_REL_L2, _dequantized_copy

    quant = {"bits": 8} if bits == 8 else {"bits": 4, "group_size": 32}
    ref, fused = _pair(name, torch.bfloat16, quant=quant)
    ref = _dequantized_copy(ref, fused)
    # 9 rows: up to quant.TRITON_QUANT_MAX_ROWS a CUDA call runs the Triton kernels
    ids, mask = (t.to(DEV) for t in prompts(batch=1))
    name = f"linear_int{bits}_triton"
    with torch.inference_mode():
        a = ref(ids, attention_mask=mask).logits.float()
        b = fused(ids, attention_mask=mask).logits.float()
        assert triton_calls[name] > 0, dict(triton_calls)
        out = fused.generate(ids, attention_mask=mask, **GEN)
    valid = mask.bool()
    rel = (a[valid] - b[valid]).norm() / a[valid].norm()
    assert rel <= BF16_REL_L2, rel.item()
    assert out.shape == (1, ids.shape[1] + GEN["max_new_tokens"])


@pytest.mark.parametrize("bits", (8, 4))
def test_quantized_prefill_runs_cublas(triton_calls, bits):
    """Past TRITON_QUANT_MAX_ROWS rows a quantized linear dequantizes and runs cuBLAS (the
    Triton kernels lost 2-6x there on an H200); asking for Triton by name still runs it."""
    w = _randn(512, 256, dtype=torch.bfloat16, scale=256**-0.5)
    qw = Q.quantize_int8(w) if bits == 8 else Q.quantize_int4(w, 32, False)
    fast = Q.linear_int8 if bits == 8 else Q.linear_int4
    name = f"linear_int{bits}_triton"
    fast(_randn(Q.TRITON_QUANT_MAX_ROWS + 1, 256, dtype=torch.bfloat16), qw, backend="auto")
    assert triton_calls[name] == 0
    fast(_randn(Q.TRITON_QUANT_MAX_ROWS, 256, dtype=torch.bfloat16), qw, backend="auto")
    fast(_randn(64, 256, dtype=torch.bfloat16), qw, backend="triton")
    assert triton_calls[name] == 2
