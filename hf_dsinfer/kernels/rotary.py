"""Rotary position embeddings (RoPE): the cos/sin tables and their application to q and k.

rope_cos_sin(inv_freq, position_ids)  -> cos, sin [B, S, R], R = 2 * len(inv_freq)
apply_rotary(q, k, cos, sin)          q [B, Hq, S, D], k [B, Hk, S, D] -> rotated copies

Two layouts of the rotated pairs exist in Hugging Face models:
    rotate-half (Llama, Mistral, GPT-NeoX...): dim i pairs with dim i + R/2;
        cos/sin = cat(freqs, freqs); out = x * cos + rotate_half(x) * sin,
        rotate_half(x) = cat(-x[R/2:], x[:R/2]).
    interleaved (GPT-J "rotate_every_two"): dim 2i pairs with dim 2i + 1;
        cos/sin = freqs.repeat_interleave(2); pair (x0, x1) -> (x0 c - x1 s, x1 c + x0 s).
Partial rotary (GPT-NeoX / GPT-J `rotary_dim`): only the first R <= D dims of each head rotate;
the remaining D - R pass through unchanged.

Numerics (HF): the angles `position * inv_freq` and their cos/sin are computed in fp32 with
autocast off, scaled by `attention_scaling`, then cast to the activations' dtype; the rotation
itself runs in q's dtype (each product and the sum round to it, as eager does). OLMo 2 keeps
cos / sin in fp32: the rotation of bf16 q runs in fp32 and rounds once at the end, as its
eager code does; such calls take the reference on every backend.
"""

from __future__ import annotations

import functools
import types

import torch

from hf_dsinfer.kernels import _dispatch, _native


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor,
                 attention_scaling: float = 1.0, *, interleaved: bool = False,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, S, R] for position_ids [B, S] and inv_freq [R/2], as LlamaRotaryEmbedding."""
    device_type = position_ids.device.type if position_ids.device.type != "mps" else "cpu"
    with torch.autocast(device_type=device_type, enabled=False):  # angles must stay fp32
        # [B, S, 1] * [R/2] -> [B, S, R/2]; a K=1 product, identical to HF's matmul form.
        freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device).float()
        if interleaved:
            emb = freqs.repeat_interleave(2, dim=-1)  # [B, S, R]: f0 f0 f1 f1 ...
        else:
            emb = torch.cat((freqs, freqs), dim=-1)  # [B, S, R]: f0 f1 ... f0 f1 ...
        cos = emb.cos() * attention_scaling
        sin = emb.sin() * attention_scaling
    return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                interleaved: bool) -> torch.Tensor:
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    turned = _rotate_every_two(x_rot) if interleaved else _rotate_half(x_rot)
    out = x_rot * cos + turned * sin
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out


def apply_rotary_ref(q, k, cos, sin, interleaved=False):
    """Reference: HF's apply_rotary_pos_emb (Llama; OLMo 2's with fp32 cos / sin) / GPT-J's,
    with partial rotary: products in the promotion of q's and cos' dtypes, the result in q's."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, S, R], broadcast over heads
    return tuple(_rotate_ref(x, cos, sin, interleaved).to(x.dtype) for x in (q, k))


# ----------------------------------------------------------------------------- Triton kernel
# One program rotates a [BLOCK_S, R] tile of one (batch, head). Element j of the first operand
# pairs with j + R/2 (rotate-half) or 2j with 2j + 1 (interleaved); both are the same code with
# different index maps. Products and the sum are rounded to x's dtype like the eager ops.


@functools.cache
def _kernels() -> types.SimpleNamespace:
    """Import Triton and define its kernels (once per process)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _apply_rotary_kernel(X, COS, SIN, OUT, heads, seq, rot, dim,
                             sxb, sxh, sxs, scb, scs, INTERLEAVED: tl.constexpr,
                             BLOCK_S: tl.constexpr, BLOCK_HALF: tl.constexpr,
                             BLOCK_PASS: tl.constexpr):
        pid_s, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)[:, None]  # [BLOCK_S, 1]
        j = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
        m = (s < seq) & (j < rot // 2)
        if INTERLEAVED:
            i1 = 2 * j
            i2 = i1 + 1
        else:
            i1 = j
            i2 = j + rot // 2
        x_row = X + b * sxb + h * sxh + s * sxs
        o_row = OUT + ((b * heads + h) * seq + s) * dim  # OUT is contiguous [B, H, S, D]
        c_row = b * scb + s * scs
        dt = OUT.dtype.element_ty
        x1 = tl.load(x_row + i1, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + i2, mask=m, other=0.0).to(tl.float32)
        # HF casts cos/sin to q's dtype before the rotation.
        c1 = tl.load(COS + c_row + i1, mask=m, other=0.0).to(dt).to(tl.float32)
        c2 = tl.load(COS + c_row + i2, mask=m, other=0.0).to(dt).to(tl.float32)
        s1 = tl.load(SIN + c_row + i1, mask=m, other=0.0).to(dt).to(tl.float32)
        s2 = tl.load(SIN + c_row + i2, mask=m, other=0.0).to(dt).to(tl.float32)
        o1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
        o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
        tl.store(o_row + i1, o1.to(dt), mask=m)
        tl.store(o_row + i2, o2.to(dt), mask=m)
        if BLOCK_PASS > 0:  # partial rotary: copy dims [rot, dim) unchanged
            p = rot + tl.arange(0, BLOCK_PASS)[None, :]
            mp = (s < seq) & (p < dim)
            tl.store(o_row + p, tl.load(x_row + p, mask=mp, other=0.0), mask=mp)

    return types.SimpleNamespace(
        cdiv=triton.cdiv, next_power_of_2=triton.next_power_of_2,
        apply_rotary=_apply_rotary_kernel,
    )


def _check_rotary_dims(x: torch.Tensor, cos: torch.Tensor) -> None:
    rot, dim = cos.shape[-1], x.shape[-1]
    if rot % 2 or rot > dim:
        raise ValueError(
            f"apply_rotary: cos/sin last dim must be even and <= head_dim {dim}, got {rot}. "
            "Fix: build them with rope_cos_sin from an inv_freq of length rotary_dim // 2."
        )


def _rotate_triton(x, cos, sin, interleaved):
    k = _kernels()
    x = x if x.stride(-1) == 1 else x.contiguous()
    bsz, heads, seq, dim = x.shape
    rot = cos.shape[-1]
    cos = cos.expand(bsz, seq, rot)  # a batch of 1 broadcasts with stride 0
    sin = sin.expand(bsz, seq, rot)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((bsz, heads, seq, dim), dtype=x.dtype, device=x.device)
    block_s = 16
    grid = (k.cdiv(seq, block_s), heads, bsz)
    k.apply_rotary[grid](
        x, cos, sin, out, heads, seq, rot, dim,
        x.stride(0), x.stride(1), x.stride(2), cos.stride(0), cos.stride(1),
        INTERLEAVED=interleaved, BLOCK_S=block_s, BLOCK_HALF=k.next_power_of_2(rot // 2),
        BLOCK_PASS=k.next_power_of_2(dim - rot) if dim > rot else 0,
    )
    return out


def apply_rotary_triton(q, k, cos, sin, interleaved=False):
    return _rotate_triton(q, cos, sin, interleaved), _rotate_triton(k, cos, sin, interleaved)


def _native_rope_fits(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """x [B, H, S, D] bf16 with each token's heads contiguous (the transposed view of a
    [B, S, H, D] projection, or S == 1), cos / sin [B, S, R] contiguous bf16 of x's batch."""
    b, h, s, d = x.shape
    return (x.dtype == cos.dtype == torch.bfloat16 and x.stride(3) == 1 and x.stride(1) == d
            and (s == 1 or x.stride(2) == h * d) and (b == 1 or x.stride(0) == s * h * d)
            and cos.dim() == 3 and cos.shape[0] == b and cos.shape[1] == s
            and cos.is_contiguous())


def _rotate_native(lib, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    b, h, s, d = x.shape
    out = x.clone()  # rotated copies, as the reference returns (the clone keeps x's strides)
    code = lib.hfd_rope_rows_bf16(out.data_ptr(), b * s, h, d, cos.shape[-1], h * d,
                                  cos.data_ptr(), sin.data_ptr(), cos.shape[-1],
                                  torch.get_num_threads())
    _native.check(code, "hfd_rope_rows_bf16")
    return out


def apply_rotary_cpu(q, k, cos, sin, interleaved=False):
    """The reference's bits from the native rotation of csrc/cpu_decode.c (hfd_rope_rows_bf16:
    each product and the sum rounded to bf16, HF's eager order) for rotate-half bf16 q, k whose
    heads are contiguous per token; the reference otherwise (interleaved pairs, other dtypes and
    layouts, autograd, a torch.compile trace, a tier below _native.MIN_TIER["rows"])."""
    lib = _native.lib("rows")
    if (lib is None or interleaved or q.device.type != "cpu" or sin.shape != cos.shape
            or not sin.is_contiguous() or not _native_rope_fits(q, cos)
            or not _native_rope_fits(k, cos)
            or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))):
        return apply_rotary_ref(q, k, cos, sin, interleaved)
    return _rotate_native(lib, q, cos, sin), _rotate_native(lib, k, cos, sin)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                 interleaved: bool = False,
                 backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first R = cos.shape[-1] dims of q [B, Hq, S, D] and k [B, Hk, S, D]."""
    _check_rotary_dims(q, cos)
    if cos.dtype != q.dtype:  # OLMo 2's fp32 rotation of half-precision q, k
        return apply_rotary_ref(q, k, cos, sin, interleaved)
    fn = _dispatch.pick(backend, q.device, ref=apply_rotary_ref, triton_fn=apply_rotary_triton,
                        cpu_fn=apply_rotary_cpu)
    return fn(q, k, cos, sin, interleaved)
