"""KV-cache compression: int8 per head vector and FlexGen's 4-bit group-wise min-max.

int8 (symmetric, one scale per [head_dim] vector, i.e. per token and head):
    scale = max |x| / 127,  q = round(x / scale) in [-127, 127],  x ~ q * scale
int4 (FlexGen: asymmetric min-max, groups of `group_size` (default 64) along head_dim):
    scale = (max - min) / 15,  q = round((x - min) / scale) in [0, 15],  x ~ q * scale + min
    two values per byte (even index in the low nibble), scale and min stored in fp16.
`group_size` must divide head_dim (no padding; pick group_size = head_dim for small heads).
Rounding is half-up (floor(v + 0.5)) in every backend, so the reference and the Triton
kernels produce identical codes (Triton has no portable round-half-even).

Shapes: x [..., D] (a cache tensor [B, heads, S, D]); KVInt8.q [..., D] int8, .scales [..., 1]
in x.dtype; KVInt4.packed [..., D // 2] uint8, .scales / .mins [..., D // group_size] fp16.
On the CPU the references are a handful of vectorized torch ops; `dequantize_kv_int4_tokens`
decodes a token-major cache (the offload engine's) with the native kernel of csrc/cpu_quant.c,
an order of magnitude faster than those ops (measured: docs/performance.md, "Behind the code").
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch

from hf_dsinfer.kernels import _dispatch, _native, abi
from hf_dsinfer.kernels.quant import pack_int4, unpack_int4


class KVInt8(NamedTuple):
    q: torch.Tensor  # [..., D] int8
    scales: torch.Tensor  # [..., 1], dtype of the cache


class KVInt4(NamedTuple):
    packed: torch.Tensor  # [..., D // 2] uint8
    scales: torch.Tensor  # [..., D // group_size] fp16
    mins: torch.Tensor  # [..., D // group_size] fp16
    group_size: int


def _check_group(head_dim: int, group_size: int) -> None:
    if head_dim % group_size or group_size % 2:
        raise ValueError(
            f"quantize_kv_int4: group_size must be even and divide head_dim={head_dim}, got "
            f"{group_size}. Fix: use group_size=64 (FlexGen) or group_size=head_dim."
        )


# ----------------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------------


def quantize_kv_int8_ref(x: torch.Tensor) -> KVInt8:
    xf = x.float()
    scales = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-10).to(x.dtype)
    q = torch.floor(xf / scales.float() + 0.5).clamp(-127, 127).to(torch.int8)
    return KVInt8(q, scales)


def dequantize_kv_int8_ref(kv: KVInt8, dtype: torch.dtype | None = None) -> torch.Tensor:
    return (kv.q.float() * kv.scales.float()).to(dtype or kv.scales.dtype)


def quantize_kv_int4_ref(x: torch.Tensor, group_size: int = 64) -> KVInt4:
    _check_group(x.shape[-1], group_size)
    xg = x.float().unflatten(-1, (-1, group_size))  # [..., G, g]
    lo, hi = xg.amin(dim=-1), xg.amax(dim=-1)  # [..., G]
    scales = ((hi - lo) / 15.0).clamp(min=1e-10).half()
    mins = lo.half()
    q = torch.floor((xg - mins.float()[..., None]) / scales.float()[..., None] + 0.5)
    q = q.clamp(0, 15).flatten(-2)  # [..., D]
    return KVInt4(pack_int4(q), scales, mins, group_size)


def dequantize_kv_int4_ref(kv: KVInt4, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    q = unpack_int4(kv.packed).float().unflatten(-1, (-1, kv.group_size))  # [..., G, g]
    x = q * kv.scales.float()[..., None] + kv.mins.float()[..., None]
    return x.flatten(-2).to(dtype)


# ----------------------------------------------------------------------------------------------
# Triton kernels: one program per row (int8: a head vector; int4: a group)
# ----------------------------------------------------------------------------------------------


class _Kernels(NamedTuple):
    triton: object
    quant8: object
    dequant8: object
    quant4: object
    dequant4: object


@functools.lru_cache(maxsize=1)
def _kernels() -> _Kernels:
    """Import Triton and define the kernels on first use (the module imports without Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _quantize_kv_int8_kernel(x_ptr, q_ptr, s_ptr, D, BLOCK_D: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + row * D + offs, mask=offs < D, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 127.0, 1e-10)
        scale = scale.to(s_ptr.dtype.element_ty)  # stored scale, used for the codes too
        q = tl.floor(x / scale.to(tl.float32) + 0.5)
        q = tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int8)
        tl.store(q_ptr + row * D + offs, q, mask=offs < D)
        tl.store(s_ptr + row, scale)

    @triton.jit
    def _dequantize_kv_int8_kernel(q_ptr, s_ptr, y_ptr, D, BLOCK_D: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK_D)
        q = tl.load(q_ptr + row * D + offs, mask=offs < D, other=0).to(tl.float32)
        y = q * tl.load(s_ptr + row).to(tl.float32)
        tl.store(y_ptr + row * D + offs, y.to(y_ptr.dtype.element_ty), mask=offs < D)

    @triton.jit
    def _quantize_kv_int4_kernel(x_ptr, p_ptr, s_ptr, m_ptr, HALF: tl.constexpr):
        # One group of 2 * HALF values: min-max, codes, and pairs packed into HALF bytes.
        row = tl.program_id(0)
        offs = tl.arange(0, HALF)
        even = tl.load(x_ptr + row * 2 * HALF + 2 * offs).to(tl.float32)
        odd = tl.load(x_ptr + row * 2 * HALF + 2 * offs + 1).to(tl.float32)
        lo = tl.minimum(tl.min(even, axis=0), tl.min(odd, axis=0))
        hi = tl.maximum(tl.max(even, axis=0), tl.max(odd, axis=0))
        scale = tl.maximum((hi - lo) / 15.0, 1e-10).to(tl.float16)
        low = lo.to(tl.float16)
        sf, lf = scale.to(tl.float32), low.to(tl.float32)
        q_even = tl.minimum(tl.maximum(tl.floor((even - lf) / sf + 0.5), 0.0), 15.0)
        q_odd = tl.minimum(tl.maximum(tl.floor((odd - lf) / sf + 0.5), 0.0), 15.0)
        byte = q_even.to(tl.uint8) | (q_odd.to(tl.uint8) << 4)
        tl.store(p_ptr + row * HALF + offs, byte)
        tl.store(s_ptr + row, scale)
        tl.store(m_ptr + row, low)

    @triton.jit
    def _dequantize_kv_int4_kernel(p_ptr, s_ptr, m_ptr, y_ptr, HALF: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, HALF)
        byte = tl.load(p_ptr + row * HALF + offs)
        scale = tl.load(s_ptr + row).to(tl.float32)
        low = tl.load(m_ptr + row).to(tl.float32)
        dt = y_ptr.dtype.element_ty
        tl.store(y_ptr + row * 2 * HALF + 2 * offs, ((byte & 0xF).to(tl.float32) * scale
                                                     + low).to(dt))
        tl.store(y_ptr + row * 2 * HALF + 2 * offs + 1, ((byte >> 4).to(tl.float32) * scale
                                                         + low).to(dt))

    return _Kernels(triton, _quantize_kv_int8_kernel, _dequantize_kv_int8_kernel,
                           _quantize_kv_int4_kernel, _dequantize_kv_int4_kernel)


def quantize_kv_int8_triton(x: torch.Tensor) -> KVInt8:
    k = _kernels()
    xc = x.contiguous()
    d = x.shape[-1]
    q = torch.empty_like(xc, dtype=torch.int8)
    scales = torch.empty(*x.shape[:-1], 1, dtype=x.dtype, device=x.device)
    k.quant8[(xc.numel() // d,)](xc, q, scales, d, BLOCK_D=k.triton.next_power_of_2(d))
    return KVInt8(q, scales)


def dequantize_kv_int8_triton(kv: KVInt8, dtype: torch.dtype | None = None) -> torch.Tensor:
    k = _kernels()
    d = kv.q.shape[-1]
    y = torch.empty(kv.q.shape, dtype=dtype or kv.scales.dtype, device=kv.q.device)
    k.dequant8[(kv.q.numel() // d,)](kv.q.contiguous(), kv.scales.contiguous(), y, d,
                                     BLOCK_D=k.triton.next_power_of_2(d))
    return y


def quantize_kv_int4_triton(x: torch.Tensor, group_size: int = 64) -> KVInt4:
    """group_size must be a power of two here (tl.arange); others fall back to the reference."""
    _check_group(x.shape[-1], group_size)
    if group_size & (group_size - 1):
        return quantize_kv_int4_ref(x, group_size)
    k = _kernels()
    xc = x.contiguous()
    groups = xc.numel() // group_size
    gshape = (*x.shape[:-1], x.shape[-1] // group_size)
    packed = torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(gshape, dtype=torch.float16, device=x.device)
    mins = torch.empty(gshape, dtype=torch.float16, device=x.device)
    k.quant4[(groups,)](xc, packed, scales, mins, HALF=group_size // 2)
    return KVInt4(packed, scales, mins, group_size)


def dequantize_kv_int4_triton(kv: KVInt4, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    if kv.group_size & (kv.group_size - 1):
        return dequantize_kv_int4_ref(kv, dtype)
    k = _kernels()
    shape = (*kv.packed.shape[:-1], kv.packed.shape[-1] * 2)
    y = torch.empty(shape, dtype=dtype, device=kv.packed.device)
    k.dequant4[(kv.scales.numel(),)](kv.packed.contiguous(), kv.scales.contiguous(),
                                     kv.mins.contiguous(), y, HALF=kv.group_size // 2)
    return y


# ----------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------


def quantize_kv_int8(x: torch.Tensor, *, backend: str | None = None) -> KVInt8:
    """int8 codes and one scale per head vector of a KV tensor [..., D]."""
    fn = _dispatch.pick(backend, x.device, ref=quantize_kv_int8_ref,
                        triton_fn=quantize_kv_int8_triton)
    return fn(x)


def dequantize_kv_int8(kv: KVInt8, dtype: torch.dtype | None = None, *,
                       backend: str | None = None) -> torch.Tensor:
    fn = _dispatch.pick(backend, kv.q.device, ref=dequantize_kv_int8_ref,
                        triton_fn=dequantize_kv_int8_triton)
    return fn(kv, dtype)


def quantize_kv_int4(x: torch.Tensor, group_size: int = 64, *,
                     backend: str | None = None) -> KVInt4:
    """FlexGen 4-bit min-max codes, groups of `group_size` along head_dim, fp16 scale/min."""
    fn = _dispatch.pick(backend, x.device, ref=quantize_kv_int4_ref,
                        triton_fn=quantize_kv_int4_triton, cpu_fn=quantize_kv_int4_cpu)
    return fn(x, group_size)


def quantize_kv_int4_cpu(x: torch.Tensor, group_size: int = 64) -> KVInt4:
    """The reference's codes from the native kernel (csrc/cpu_quant.c, the same fp32
    operations, much faster on a prefill's cache: docs/performance.md, "Behind the code"), where it takes x;
    else the reference."""
    _check_group(x.shape[-1], group_size)
    takes = (x.dtype in _native.DTYPE_CODES and group_size % 16 == 0 and x.is_contiguous()
             and x.device.type == "cpu" and not (x.requires_grad and torch.is_grad_enabled()))
    lib = _native.lib("codes") if takes else None
    if lib is None:
        return quantize_kv_int4_ref(x, group_size)
    d = x.shape[-1]
    packed = torch.empty(*x.shape[:-1], d // 2, dtype=torch.uint8)
    scales = torch.empty(*x.shape[:-1], d // group_size, dtype=torch.float16)
    mins = torch.empty_like(scales)
    if x.numel():
        lib.hfd_quant_kv_int4(x.data_ptr(), _native.DTYPE_CODES[x.dtype], x.numel() // d, d,
                              group_size, packed.data_ptr(), scales.data_ptr(), mins.data_ptr(),
                              torch.get_num_threads())
    return KVInt4(packed, scales, mins, group_size)


def dequantize_kv_int4(kv: KVInt4, dtype: torch.dtype = torch.float16, *,
                       backend: str | None = None) -> torch.Tensor:
    fn = _dispatch.pick(backend, kv.packed.device, ref=dequantize_kv_int4_ref,
                        triton_fn=dequantize_kv_int4_triton)
    return fn(kv, dtype)


def dequantize_kv_int4_tokens(kv: KVInt4, dtype: torch.dtype,
                              out: torch.Tensor | None = None) -> torch.Tensor:
    """A token-major 4-bit cache, packed [T, rows, heads, D // 2] with scales / mins
    [T, rows, heads, G] (the token dim may be strided, as in a cache file's records; the rest
    contiguous), decoded to [rows, heads, T, D]: the layout attention reads, so no permuted copy
    follows. Written into `out` when given ([rows, heads, T, D], a slice along T of a contiguous
    tensor is fine). Same values as `dequantize_kv_int4` to the bit; the native CPU kernel runs
    where it can, torch ops elsewhere."""
    tokens, rows, heads, half = kv.packed.shape
    d = 2 * half
    if out is None:
        out = torch.empty(rows, heads, tokens, d, dtype=dtype, device=kv.packed.device)
    lib = _native_kv_lib(kv, dtype, out)
    if lib is None:
        out.copy_(dequantize_kv_int4(kv, dtype).permute(1, 2, 0, 3))
        return out
    if tokens:
        lib.hfd_dequant_kv_int4(kv.packed.data_ptr(), kv.scales.data_ptr(), kv.mins.data_ptr(),
                                kv.packed.stride(0), kv.scales.stride(0) * 2, tokens,
                                rows * heads, d, kv.group_size, out.data_ptr(),
                                _native.DTYPE_CODES[dtype], out.stride(1) // d,
                                torch.get_num_threads())
    return out


def _native_kv_lib(kv: KVInt4, dtype: torch.dtype, out: torch.Tensor):
    """The native library when its KV decoding takes these tensors (see cpu_quant.c)."""
    packed, scales, mins = kv.packed, kv.scales, kv.mins
    tokens, rows, heads, half = packed.shape
    d, groups = 2 * half, scales.shape[-1]

    def inner_contiguous(t: torch.Tensor) -> bool:
        return t.stride()[1:] == (heads * t.shape[-1], t.shape[-1], 1)

    if (dtype not in _native.DTYPE_CODES or kv.group_size % 16 or d % kv.group_size
            or packed.dtype != torch.uint8 or scales.dtype != torch.float16
            or mins.dtype != torch.float16 or groups != d // kv.group_size
            or any(t.device.type != "cpu" for t in (packed, scales, mins, out))
            or not all(inner_contiguous(t) for t in (packed, scales, mins))
            or scales.stride(0) != mins.stride(0) or out.dtype != dtype
            or tuple(out.shape) != (rows, heads, tokens, d)
            or out.stride(3) != 1 or out.stride(2) != d or out.stride(1) % d
            or out.stride(0) != heads * out.stride(1) or out.requires_grad):
        return None
    return _native.lib("codes")


# ----------------------------------------------------------------------------------------------
# Decode attention over a token-major 4-bit cache (FlexGen: attention where the cache lives)
# ----------------------------------------------------------------------------------------------


class KVSpan(NamedTuple):
    """Consecutive tokens of a token-major 4-bit cache: K and V codes, packed
    [T, rows, kv_heads, D // 2] and scales / mins [T, rows, kv_heads, G] (the token dim may be
    strided, as in a cache file's records; the rest contiguous)."""

    k: KVInt4
    v: KVInt4


_Span = abi.KVSpan  # hfd_api.h: hfd_kv_span


def attend_kv_int4_ref(q: torch.Tensor, spans: list[KVSpan], scale: float,
                       keep: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(scale * q K^T) V for one query per sequence and head, q [rows, heads, D], over
    the spans' tokens in order, each code read as its fp32 value (q * scale + min); keep:
    [rows or 1, T], 0 / False masks a key (a row masked everywhere: zeros). fp32 throughout
    (fp64 when q is), returned in q's dtype. The reference of `attend_kv_int4` (tests, and
    where the native kernel does not run)."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32

    def dense(codes: KVInt4) -> torch.Tensor:  # [rows, kv_heads, T, D]
        x = unpack_int4(codes.packed).to(work).unflatten(-1, (-1, codes.group_size))
        x = x * codes.scales.to(work)[..., None] + codes.mins.to(work)[..., None]
        return x.flatten(-2).permute(1, 2, 0, 3)

    k = torch.cat([dense(s.k) for s in spans], dim=2)
    v = torch.cat([dense(s.v) for s in spans], dim=2)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("rhd,rhtd->rht", q.to(work), k) * scale
    if keep is not None:
        scores = scores.masked_fill(~keep.bool()[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("rht,rhtd->rhd", probs, v).to(q.dtype)


def attend_kv_int4(q: torch.Tensor, spans: list[KVSpan], scale: float,
                   keep: torch.Tensor | None = None, out: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Decode attention straight over 4-bit K/V codes, no dense copy of the cache: q
    [rows, heads, D] (one query per sequence and head; heads a multiple of the cache's kv_heads)
    against the spans' tokens in order; keep: bool / uint8 [rows or 1, T] (0 masks a key; what
    kernels/decode.py's keep_rows makes of HF's mask) or None. Returns [rows, heads, D] in q's
    dtype (into `out` when given). The native kernel (csrc/cpu_quant.c: hfd_attend_kv_int4)
    runs where it takes the tensors (counted in ATTEND_CALLS), the reference elsewhere."""
    _check_attend(q, spans, keep)
    lib = _native_attend_lib(q, spans, keep, out)
    if lib is None:
        result = attend_kv_int4_ref(q, spans, scale, keep)
        return result if out is None else out.copy_(result)
    rows, heads, d = q.shape
    if out is None:
        out = torch.empty_like(q)
    table = (_Span * len(spans))()
    for entry, span in zip(table, spans):
        for prefix, codes in (("k", span.k), ("v", span.v)):
            setattr(entry, prefix + "p", codes.packed.data_ptr())
            setattr(entry, prefix + "s", codes.scales.data_ptr())
            setattr(entry, prefix + "m", codes.mins.data_ptr())
        entry.p_stride = span.k.packed.stride(0)
        entry.s_stride = span.k.scales.stride(0) * 2
        entry.tokens = span.k.packed.shape[0]
    if keep is not None:
        keep = keep.contiguous().view(torch.uint8)
    code = _native.DTYPE_CODES[q.dtype]
    _native.check(lib.hfd_attend_kv_int4(
        q.data_ptr(), code, ctypes.addressof(table), len(spans), rows, heads,
        spans[0].k.packed.shape[2], d, spans[0].k.group_size,
        None if keep is None else keep.data_ptr(),
        0 if keep is None or keep.shape[0] == 1 else keep.stride(0), float(scale), code,
        out.data_ptr(), code, torch.get_num_threads()), "hfd_attend_kv_int4")
    ATTEND_CALLS["native"] += 1
    return out


def _check_attend(q: torch.Tensor, spans: list[KVSpan], keep: torch.Tensor | None) -> None:
    if q.dim() != 3 or not spans:
        raise ValueError(f"attend_kv_int4: expected q [rows, heads, D] and at least one span, got "
                         f"q {tuple(q.shape)} and {len(spans)} spans. Fix: one query per sequence "
                         "and head (q[:, :, 0] of a decode step's [B, heads, 1, D]).")
    rows, heads, d = q.shape
    kv_heads = spans[0].k.packed.shape[2]
    for span in spans:
        for codes in (span.k, span.v):
            t = codes.packed.shape[0]
            if (tuple(codes.packed.shape) != (t, rows, kv_heads, d // 2) or heads % kv_heads
                    or codes.scales.shape != (t, rows, kv_heads, d // codes.group_size)
                    or codes.mins.shape != codes.scales.shape
                    or codes.group_size != spans[0].k.group_size
                    or span.v.packed.shape[0] != t):
                raise ValueError(
                    f"attend_kv_int4: every span's K and V codes must be packed [T, {rows}, "
                    f"{kv_heads}, {d // 2}] ({kv_heads} kv heads dividing {heads}) with scales / "
                    f"mins [T, {rows}, {kv_heads}, {d}/group], one group, got packed "
                    f"{tuple(codes.packed.shape)}, scales {tuple(codes.scales.shape)}, mins "
                    f"{tuple(codes.mins.shape)}, group {codes.group_size}. Fix: pass "
                    "quantize_kv_int4 codes of a token-major cache [T, rows, kv_heads, D].")
    total = sum(span.k.packed.shape[0] for span in spans)
    if keep is not None and (keep.dim() != 2 or keep.shape[0] not in (1, rows)
                             or keep.shape[1] != total
                             or keep.dtype not in (torch.bool, torch.uint8)):
        raise ValueError(f"attend_kv_int4: keep must be bool or uint8 [{rows} or 1, {total}] "
                         f"(rows x every span's tokens), got {keep.dtype} {tuple(keep.shape)}. "
                         "Fix: pass keep_rows' mask of the step, or None.")


ATTEND_CALLS = {"native": 0}  # hfd_attend_kv_int4 calls (tests prove the kernel ran)


def _native_attend_lib(q: torch.Tensor, spans: list[KVSpan], keep: torch.Tensor | None,
                       out: torch.Tensor | None):
    """The native library when hfd_attend_kv_int4 takes these tensors (shapes already checked
    by _check_attend), else None."""
    d = q.shape[2]
    first = spans[0].k
    kv_heads, group = first.packed.shape[2], first.group_size
    if (q.dtype not in _native.DTYPE_CODES or q.device.type != "cpu" or d > 256 or d % group
            or group % 2 or not q.is_contiguous() or (q.requires_grad and torch.is_grad_enabled())
            or (keep is not None and keep.device.type != "cpu")
            or (out is not None and (out.shape != q.shape or out.dtype != q.dtype
                                     or not out.is_contiguous()))):
        return None
    for span in spans:
        for codes in (span.k, span.v):
            packed, scales, mins = codes.packed, codes.scales, codes.mins
            if (packed.dtype != torch.uint8 or scales.dtype != torch.float16
                    or mins.dtype != torch.float16
                    or packed.stride()[1:] != (kv_heads * d // 2, d // 2, 1)
                    or scales.stride() != mins.stride()
                    or scales.stride()[1:] != (kv_heads * (d // group), d // group, 1)
                    or packed.stride(0) != span.k.packed.stride(0)
                    or scales.stride(0) != span.k.scales.stride(0)
                    or any(x.device.type != "cpu" for x in (packed, scales, mins))):
                return None
    return _native.lib()
