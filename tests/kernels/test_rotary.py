"""rotary: cos/sin tables against LlamaRotaryEmbedding, rotation against Llama's and GPT-J's
apply_rotary_pos_emb (full and partial rotary), Triton against the reference."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.gptj import modeling_gptj
from transformers.models.llama import modeling_llama

from hf_dsinfer.kernels import rotary
from tests.kernels.conftest import INTERPRET_TOL, assert_close_tol, requires_triton

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BATCH, TOKENS, HEAD_DIM, Q_HEADS, KV_HEADS = 2, 7, 16, 6, 3
ROTARY_DIMS = (HEAD_DIM, 12)  # full and partial rotary


def _inv_freq(rot, base=10000.0):
    return 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.int64).float() / rot))


def _positions(offset=0):
    # Row 1 is left-padded by two: HF's position_ids restart at 0 after the padding.
    pos = torch.arange(TOKENS)[None].repeat(BATCH, 1) + offset
    pos[1] = (pos[1] - 2).clamp(min=0)
    return pos


def _qk(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, Q_HEADS, TOKENS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(BATCH, KV_HEADS, TOKENS, HEAD_DIM, generator=g).to(dtype)
    return q, k


def _llama_rope(scaling=None):
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if scaling:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                "original_max_position_embeddings": 32}
    cfg = LlamaConfig(hidden_size=Q_HEADS * HEAD_DIM, num_attention_heads=Q_HEADS,
                      num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                      max_position_embeddings=128, rope_parameters=rope)
    return modeling_llama.LlamaRotaryEmbedding(cfg)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("yarn", (False, True))
def test_cos_sin_match_llama_rotary_embedding(dtype, yarn):
    emb = _llama_rope(yarn)
    pos = _positions(offset=5)
    hf_cos, hf_sin = emb(torch.zeros(1, dtype=dtype), pos)
    cos, sin = rotary.rope_cos_sin(emb.inv_freq, pos, emb.attention_scaling, dtype=dtype)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_apply_rotary_ref_matches_llama(dtype):
    q, k = _qk(dtype)
    cos, sin = rotary.rope_cos_sin(_inv_freq(HEAD_DIM), _positions(), dtype=dtype)
    hf_q, hf_k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    out_q, out_k = rotary.apply_rotary_ref(q, k, cos, sin)
    assert torch.equal(out_q, hf_q) and torch.equal(out_k, hf_k)


def _gptj_rotate(x, pos, rot):
    """GPT-J's own path: x [B, H, S, D] -> its [B, S, H, D] layout, partial rotary, back."""
    table = modeling_gptj.create_sinusoidal_positions(64, rot)  # [P, rot]: sin | cos
    sincos = table[pos].to(x.dtype)  # [B, S, rot], cast to the activations' dtype as GPT-J
    sin, cos = torch.split(sincos, rot // 2, dim=-1)
    xs = x.transpose(1, 2)
    x_rot = modeling_gptj.apply_rotary_pos_emb(xs[..., :rot], sin, cos)
    return torch.cat([x_rot, xs[..., rot:]], dim=-1).transpose(1, 2)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("rot", ROTARY_DIMS)
def test_apply_rotary_ref_matches_gptj_interleaved(dtype, rot):
    q, k = _qk(dtype)
    pos = _positions()
    cos, sin = rotary.rope_cos_sin(_inv_freq(rot), pos, interleaved=True, dtype=dtype)
    out_q, out_k = rotary.apply_rotary_ref(q, k, cos, sin, interleaved=True)
    assert torch.equal(out_q, _gptj_rotate(q, pos, rot))
    assert torch.equal(out_k, _gptj_rotate(k, pos, rot))


def test_partial_rotary_passes_the_tail_through():
    q, k = _qk(torch.float32)
    cos, sin = rotary.rope_cos_sin(_inv_freq(12), _positions())
    out_q, out_k = rotary.apply_rotary(q, k, cos, sin)
    assert torch.equal(out_q[..., 12:], q[..., 12:]) and torch.equal(out_k[..., 12:], k[..., 12:])


@requires_triton()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot", ROTARY_DIMS)
@pytest.mark.parametrize("interleaved", (False, True))
def test_apply_rotary_triton(dtype, rot, interleaved):
    q, k = _qk(dtype)
    q_before, k_before = q.clone(), k.clone()
    cos, sin = rotary.rope_cos_sin(_inv_freq(rot), _positions(), interleaved=interleaved)
    out = rotary.apply_rotary(q, k, cos, sin, interleaved=interleaved, backend="triton")
    ref = rotary.apply_rotary_ref(q, k, cos, sin, interleaved=interleaved)
    assert_close_tol(out[0], ref[0], table=INTERPRET_TOL)
    assert_close_tol(out[1], ref[1], table=INTERPRET_TOL)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)  # inputs untouched


@requires_triton()
def test_apply_rotary_triton_strided_views_and_broadcast_cos():
    # q/k as HF produces them: a transpose of [B, S, H, D] projections; cos/sin for batch 1.
    g = torch.Generator().manual_seed(3)
    q = torch.randn(BATCH, TOKENS, Q_HEADS, HEAD_DIM, generator=g).transpose(1, 2)
    k = torch.randn(BATCH, TOKENS, KV_HEADS, HEAD_DIM, generator=g).transpose(1, 2)
    cos, sin = rotary.rope_cos_sin(_inv_freq(HEAD_DIM), torch.arange(TOKENS)[None] + 4)
    out = rotary.apply_rotary(q, k, cos, sin, backend="triton")
    ref = rotary.apply_rotary_ref(q, k, cos, sin)
    assert_close_tol(out[0], ref[0])
    assert_close_tol(out[1], ref[1])


@requires_triton()
def test_apply_rotary_triton_decode_single_token():
    q, k = _qk(torch.float32)
    q, k = q[:, :, -1:], k[:, :, -1:]
    cos, sin = rotary.rope_cos_sin(_inv_freq(HEAD_DIM), torch.full((BATCH, 1), 12))
    out = rotary.apply_rotary(q, k, cos, sin, backend="triton")
    ref = rotary.apply_rotary_ref(q, k, cos, sin)
    assert_close_tol(out[0], ref[0])
    assert_close_tol(out[1], ref[1])


def test_bad_rotary_dim_raises():
    q, k = _qk(torch.float32)
    cos = torch.zeros(BATCH, TOKENS, HEAD_DIM + 2)
    with pytest.raises(ValueError, match="rope_cos_sin"):
        rotary.apply_rotary(q, k, cos, cos)


@pytest.mark.parametrize("backend", ("ref", "cpu", "auto"))
def test_fp32_cos_sin_match_olmo2(backend):
    """OLMo 2 keeps cos / sin in fp32 and rotates bf16 q, k in fp32, rounding once; casting cos
    to bf16 first (Llama's numerics) differs."""
    from transformers.models.olmo2 import modeling_olmo2

    q, k = _qk(torch.bfloat16)
    cos, sin = rotary.rope_cos_sin(_inv_freq(HEAD_DIM), _positions(offset=40), dtype=torch.float32)
    hf_q, hf_k = modeling_olmo2.apply_rotary_pos_emb(q, k, cos, sin)
    out_q, out_k = rotary.apply_rotary(q, k, cos, sin, backend=backend)
    assert out_q.dtype == torch.bfloat16
    assert torch.equal(out_q, hf_q) and torch.equal(out_k, hf_k)
    llama_q, _ = rotary.apply_rotary_ref(q, k, cos.bfloat16(), sin.bfloat16())
    assert not torch.equal(llama_q, hf_q)
