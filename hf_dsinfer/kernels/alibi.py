"""ALiBi attention biases (BLOOM, MPT-style): a per-head linear penalty on key position.

alibi_slopes(H)                       -> slopes [H] float32
alibi_bias(mask_2d [B, S_k], H, dtype) -> bias [B, H, 1, S_k], added to the scaled scores

Slopes follow the ALiBi paper as BLOOM's `build_alibi_tensor` implements it: for the largest
power of two n <= H, slope_h = (2^(-8/n))^(h+1); the remaining H - n heads take every other
slope of the 2n sequence, (2^(-4/n))^(1, 3, 5, ...).

Key positions come from the 2-D padding mask, so left padding does not shift them:
position = (cumsum(mask) - 1) * mask, i.e. 0 for the first real token and 0 on padding. The
bias is `slope * position` in fp32 (an exact product of two fp32-representable values up to
2^24 positions), cast to `dtype` at the end, as HF does.
"""

from __future__ import annotations

import functools
import math
import types

import torch

from hf_dsinfer.kernels import _dispatch


def alibi_slopes(num_heads: int, device: torch.device | str | None = None) -> torch.Tensor:
    """float32 [num_heads]: HF BLOOM's `_get_alibi_slopes`, including non-power-of-2 counts."""
    pow2 = 2 ** math.floor(math.log2(num_heads))
    base = torch.full((), 2 ** (-(2 ** -(math.log2(pow2) - 3))), dtype=torch.float32,
                      device=device)
    slopes = torch.pow(base, torch.arange(1, 1 + pow2, dtype=torch.int32, device=device))
    if pow2 != num_heads:
        extra_base = torch.full((), 2 ** (-(2 ** -(math.log2(2 * pow2) - 3))),
                                dtype=torch.float32, device=device)
        remaining = min(pow2, num_heads - pow2)
        powers = torch.arange(1, 1 + 2 * remaining, 2, dtype=torch.int32, device=device)
        slopes = torch.cat([slopes, torch.pow(extra_base, powers)], dim=0)
    return slopes


def alibi_bias_ref(attention_mask_2d, num_heads, dtype):
    """Reference: BLOOM's build_alibi_tensor, shaped [B, H, 1, S_k] instead of [B*H, 1, S_k]."""
    bsz, seq = attention_mask_2d.shape
    slopes = alibi_slopes(num_heads, attention_mask_2d.device)  # [H]
    positions = ((attention_mask_2d.cumsum(dim=-1) - 1) * attention_mask_2d)[:, None, :]
    alibi = slopes[..., None] * positions  # [H, 1] * [B, 1, S] -> [B, H, S] in fp32
    return alibi.reshape(bsz, num_heads, 1, seq).to(dtype)


# ----------------------------------------------------------------------------- Triton kernel
# One program per (batch, head) walks the mask in BLOCK chunks, carrying the running count of
# real tokens so the cumulative sum spans the whole row.


@functools.cache
def _kernels() -> types.SimpleNamespace:
    """Import Triton and define its kernels (once per process)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _alibi_bias_kernel(MASK, SLOPES, OUT, heads, seq, BLOCK: tl.constexpr):
        b, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
        slope = tl.load(SLOPES + h)
        carry = tl.zeros((), dtype=tl.int64)  # real tokens seen before this chunk
        for start in range(0, seq, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            m = cols < seq
            keep = tl.load(MASK + b * seq + cols, mask=m, other=0).to(tl.int64)
            pos = (tl.cumsum(keep, axis=0) + carry - 1) * keep
            carry += tl.sum(keep, axis=0)
            out = slope * pos.to(tl.float32)
            tl.store(OUT + (b * heads + h) * seq + cols, out.to(OUT.dtype.element_ty), mask=m)

    return types.SimpleNamespace(alibi_bias=_alibi_bias_kernel)


def alibi_bias_triton(attention_mask_2d, num_heads, dtype):
    k = _kernels()
    mask = attention_mask_2d.to(torch.int32).contiguous()  # [B, S]; bool/int64 -> int32
    bsz, seq = mask.shape
    slopes = alibi_slopes(num_heads, mask.device)
    out = torch.empty((bsz, num_heads, 1, seq), dtype=dtype, device=mask.device)
    k.alibi_bias[(bsz, num_heads)](mask, slopes, out, num_heads, seq, BLOCK=256)
    return out


# No cpu variant: the reference is a cumsum and one broadcast multiply, already optimal on CPU.


def alibi_bias(attention_mask_2d: torch.Tensor, num_heads: int, dtype: torch.dtype, *,
               backend: str | None = None) -> torch.Tensor:
    """ALiBi bias [B, H, 1, S_k] from a 2-D padding mask [B, S_k] (1 = real token)."""
    fn = _dispatch.pick(backend, attention_mask_2d.device, ref=alibi_bias_ref,
                        triton_fn=alibi_bias_triton)
    return fn(attention_mask_2d, num_heads, dtype)
