"""attention: the reference against HF's eager_attention_forward with masks from HF's own mask
builders; the CPU (sdpa) and Triton (flash / decode) paths against the reference, on GQA, padded
batches with fully masked rows, KV-cache offsets, sliding windows, ALiBi and decode."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import masking_utils as mu
from transformers.models.llama.modeling_llama import eager_attention_forward

from hf_dsinfer.kernels import attention as attn
from hf_dsinfer.kernels.alibi import alibi_bias
from tests.kernels.conftest import INTERPRET_TOL, REDUCTION_TOL, assert_close_tol, requires_triton

BATCH, Q_HEADS, KV_HEADS, HEAD_DIM = 2, 6, 3, 16
TOKENS, CACHE = 7, 13  # Sq for prefill; Sk with a cache
SCALE = HEAD_DIM**-0.5
PAD = 3  # left padding of batch row 1
# name -> (Sq, Sk, mask kind, causal, window, alibi)
CASES = {
    "causal": (TOKENS, TOKENS, None, True, None, False),
    "cache_causal": (TOKENS, CACHE, None, True, None, False),
    "bidirectional": (TOKENS, CACHE, None, False, None, False),
    "padded_bool": (TOKENS, TOKENS, "bool", True, None, False),
    "padded_float_window": (TOKENS, CACHE, "float", True, 4, False),
    "alibi_padded": (TOKENS, TOKENS, "bool", True, None, True),
    "decode_padded": (1, CACHE, "bool", True, None, False),
    "decode_window_alibi": (1, CACHE, "float", True, 5, True),
    "first_token": (1, 1, None, True, None, False),
}


def _qkv(sq, sk, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, Q_HEADS, sq, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(BATCH, KV_HEADS, sk, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(BATCH, KV_HEADS, sk, HEAD_DIM, generator=g).to(dtype)
    return q, k, v


def _pad2d(sk):
    mask = torch.ones(BATCH, sk, dtype=torch.int64)
    mask[1, :PAD] = 0
    return mask


def _hf_mask(kind, sq, sk, dtype, window=None):
    """The 4-D mask HF builds for sdpa (bool) or eager (float), causal (+ sliding window)."""
    fn = mu.causal_mask_function
    if window is not None:
        fn = mu.and_masks(fn, mu.sliding_window_overlay(window))
    common = {"batch_size": BATCH, "q_length": sq, "kv_length": sk, "q_offset": sk - sq,
              "mask_function": fn, "attention_mask": _pad2d(sk).bool()}
    if kind == "bool":
        return mu.sdpa_mask(allow_is_causal_skip=False, **common)
    return mu.eager_mask(dtype=dtype, **common)


def _case(name, dtype):
    sq, sk, kind, causal, window, use_alibi = CASES[name]
    q, k, v = _qkv(sq, sk, dtype)
    kw = {"scale": SCALE, "causal": causal, "window": window}
    if kind:
        kw["mask"] = _hf_mask(kind, sq, sk, dtype, window)
    if use_alibi:
        kw["bias"] = alibi_bias(_pad2d(sk), Q_HEADS, dtype)
    return q, k, v, kw


def _hf_eager(q, k, v, mask):
    module = types.SimpleNamespace(num_key_value_groups=Q_HEADS // KV_HEADS, training=False)
    out, _ = eager_attention_forward(module, q, k, v, mask, scaling=SCALE)
    return out.transpose(1, 2)  # HF returns [B, S, H, D]


def _has_key(mask):
    """[B, 1, Sq, 1] bool: rows with at least one attendable key."""
    keep = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
    return keep.any(dim=-1, keepdim=True)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("kind", ("bool", "float"))
@pytest.mark.parametrize("sq,sk,window", ((TOKENS, TOKENS, None), (TOKENS, CACHE, 4),
                                          (1, CACHE, None)))
def test_ref_matches_hf_eager_with_hf_masks(dtype, kind, sq, sk, window):
    q, k, v = _qkv(sq, sk, dtype)
    mask = _hf_mask(kind, sq, sk, dtype, window)
    float_mask = _hf_mask("float", sq, sk, dtype, window)  # HF eager takes the float one
    out = attn.attention_ref(q, k, v, scale=SCALE, mask=mask)
    expected = _hf_eager(q, k, v, float_mask)
    rows = _has_key(mask).expand_as(out)
    assert torch.equal(out[rows], expected[rows])
    assert (out[~rows] == 0).all()  # HF averages v on rows with no key; we return zeros


@pytest.mark.parametrize("window", (None, 4))
def test_causal_and_window_flags_equal_hf_masks(window):
    q, k, v = _qkv(TOKENS, CACHE, torch.float32)
    hf_mask = _hf_mask("bool", TOKENS, CACHE, torch.float32, window)[:1]  # row 0: no padding
    expected = attn.attention_ref(q[:1], k[:1], v[:1], scale=SCALE, mask=hf_mask)
    out = attn.attention_ref(q[:1], k[:1], v[:1], scale=SCALE, causal=True, window=window)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("name", CASES)
def test_cpu_matches_ref(dtype, name):
    q, k, v, kw = _case(name, dtype)
    out = attn.attention(q, k, v, backend="cpu", **kw)
    assert not out.isnan().any()
    assert_close_tol(out, attn.attention_ref(q, k, v, **kw), table=REDUCTION_TOL)


@requires_triton()
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("name", CASES)
def test_triton_matches_ref(dtype, name):
    q, k, v, kw = _case(name, dtype)
    out = attn.attention(q, k, v, backend="triton", **kw)
    assert not out.isnan().any()
    tol = {**REDUCTION_TOL, torch.bfloat16: INTERPRET_TOL[torch.bfloat16]}
    assert_close_tol(out, attn.attention_ref(q, k, v, **kw), table=tol)


@requires_triton()
@pytest.mark.parametrize("name", ("padded_float_window", "decode_padded"))
def test_triton_fp16(name):
    q, k, v, kw = _case(name, torch.float16)
    assert_close_tol(attn.attention(q, k, v, backend="triton", **kw),
                     attn.attention_ref(q, k, v, **kw), table=REDUCTION_TOL)


@pytest.mark.parametrize("backend", ("ref", "cpu", pytest.param("triton", marks=requires_triton())))
def test_fully_masked_rows_are_zero_not_nan(backend):
    q, k, v, kw = _case("padded_bool", torch.float32)
    out = attn.attention(q, k, v, backend=backend, **kw)
    assert not out.isnan().any()
    assert (out[1, :, :PAD] == 0).all()  # causal + left padding: those queries see no key


@requires_triton()
def test_triton_strided_inputs_and_long_cache():
    # q/k/v as transposes of [B, S, H, D] projections; a cache longer than several key tiles.
    g = torch.Generator().manual_seed(1)
    q = torch.randn(BATCH, 1, Q_HEADS, HEAD_DIM, generator=g).transpose(1, 2)
    k = torch.randn(BATCH, 150, KV_HEADS, HEAD_DIM, generator=g).transpose(1, 2)
    v = torch.randn(BATCH, 150, KV_HEADS, HEAD_DIM, generator=g).transpose(1, 2)
    for sq in (1, 5):
        qq = q.expand(-1, -1, sq, -1)
        out = attn.attention(qq, k, v, scale=SCALE, causal=True, window=70, backend="triton")
        ref = attn.attention_ref(qq, k, v, scale=SCALE, causal=True, window=70)
        assert_close_tol(out, ref, table=REDUCTION_TOL)


def test_auto_on_cpu_runs_the_sdpa_path(monkeypatch):
    calls = []
    real = attn.attention_cpu
    monkeypatch.setattr(attn, "attention_cpu", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, kw = _case("causal", torch.float32)
    attn.attention(q, k, v, backend="auto", **kw)
    assert calls == [1]


def test_bad_head_counts_raise():
    q, _, _ = _qkv(TOKENS, TOKENS, torch.float32)
    k = torch.zeros(BATCH, 4, TOKENS, HEAD_DIM)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        attn.attention(q, k, k, scale=SCALE)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("mask_kind", ("batch", "per_head", "none"))
def test_cpu_decode_groups_query_heads_per_kv_head(dtype, mask_kind, monkeypatch):
    """A decode step with GQA runs sdpa once per kv head on its `rep` query heads as query rows
    (q [B, Hkv, rep, D]); q strided as the transpose of a [B, 1, Hq, D] projection, masks per
    batch row or per head, and a batch row with no attendable key (zeros, not NaN)."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(BATCH, 1, Q_HEADS, HEAD_DIM, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(BATCH, KV_HEADS, CACHE, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(BATCH, KV_HEADS, CACHE, HEAD_DIM, generator=g).to(dtype)
    kw = {"scale": SCALE, "causal": True}
    if mask_kind != "none":
        heads = 1 if mask_kind == "batch" else Q_HEADS
        keep = torch.rand(BATCH, heads, 1, CACHE, generator=g) > 0.3
        keep[1] = False  # batch row 1 sees no key
        kw["mask"] = keep
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(attn.F, "scaled_dot_product_attention",
                        lambda q, *a, **k: seen.append(tuple(q.shape)) or sdpa(q, *a, **k))
    out = attn.attention(q, k, v, backend="cpu", **kw)
    assert seen == [(BATCH, KV_HEADS, Q_HEADS // KV_HEADS, HEAD_DIM)]
    assert out.shape == (BATCH, Q_HEADS, 1, HEAD_DIM) and not out.isnan().any()
    assert_close_tol(out, attn.attention_ref(q, k, v, **kw), table=REDUCTION_TOL)
    if mask_kind != "none":
        assert (out[1] == 0).all()


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("kind", ("bool", "float"))
@pytest.mark.parametrize("backend", ("ref", "cpu"))
def test_softcap_matches_gemma2_eager(dtype, kind, backend):
    """Gemma 2's attention logit soft-cap, against HF's own eager function (every backend takes
    the reference for it); a cap small enough to change the result."""
    from transformers.models.gemma2.modeling_gemma2 import (
        eager_attention_forward as gemma2_eager,
    )

    q, k, v = _qkv(TOKENS, CACHE, dtype)
    q = q * 4  # scores well past the cap
    mask, float_mask = (_hf_mask(kind, TOKENS, CACHE, dtype, 4),
                        _hf_mask("float", TOKENS, CACHE, dtype, 4))
    out = attn.attention(q, k, v, scale=SCALE, mask=mask, softcap=2.0, backend=backend)
    module = types.SimpleNamespace(num_key_value_groups=Q_HEADS // KV_HEADS, training=False)
    expected = gemma2_eager(module, q, k, v, float_mask, scaling=SCALE, softcap=2.0)[0]
    rows = _has_key(mask).expand_as(out)
    assert torch.equal(out[rows], expected.transpose(1, 2)[rows])
    uncapped = attn.attention(q, k, v, scale=SCALE, mask=mask, backend=backend)
    assert not torch.allclose(out[rows], uncapped[rows], atol=1e-2)
