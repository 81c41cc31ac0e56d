"""Weight-only quantized linear layers: int8 per output channel and 4-bit group-wise.

int8 (ZeroQuant-style, symmetric, per output channel):
    scale[o] = max_i |W[o, i]| / 127        stored in the weight's dtype
    q[o, i]  = round(W[o, i] / scale[o])    int8 in [-127, 127]
    W ~ q * scale

int4 (group-wise along the input dim, `group_size` in {32, 64, 128, 256}, two values per byte):
    asymmetric (FlexGen min-max): scale = (max - min) / 15, q = round((W - min) / scale) in [0, 15]
    symmetric:                    scale = absmax / 7,       q = round(W / scale) + 8 in [0, 15]
    both dequantize as            W ~ q * scale + mins      (symmetric: mins = -8 * scale)
Scales and mins are stored in the weight's dtype (fp16 for an fp16 model, as FlexGen does);
quantization uses the stored (rounded) values so that dequantization is exactly consistent.
FlexGen groups weights along the output dim; we group along the input dim (K), as GPTQ/AWQ and
torch's int4 CPU kernel do, so one group is contiguous in the dot product.

Shapes and layouts:
    x       [..., in]
    Int8Weight.qweight [out, in] int8, or (.tiled) the same values as tiles
               [out // 4, in // 64, 4, 64]: the native kernels' layout, chosen at quantize time
               on CPU when the library is there (see tile_rows, int8_matrix)
               .scales [out], .in_scale [in] fp32 or None
    Int4Weight.packed  [out, in // 2] uint8, low nibble = even input column, high nibble = odd;
               or (.tiled) tiles [out // 4, in // 128, 4, 64] of those bytes, each row's
               512-column runs in the kernels' column order (int4_super_order, int4_codes)
               .scales / .mins [out, in // group_size]
               .cpu_packed / .cpu_scales_zeros: the same values in the layout of
               torch.ops.aten._weight_int4pack_mm_for_cpu, built once at quantize time on CPU
               where the codes are not tiles (the native kernels read tiles for any number
               of rows); None when the shape does not fit that kernel (out % 16 != 0), when
               torch's kernel failed its probe on this CPU (private_ops.py), or for portable
               weights. That layout is torch's private one and differs between CPUs
               (ATEN_CPU_CAPABILITY): it is made and read by torch's ops in one process only,
               never read here nor stored; what is stored (the offload engine's disk tier) is
               the row-major codes of quantize_int4(..., portable=True).
    out     [..., out] in x.dtype

CPU fast paths (see benchmarks/kernel_ops.py; measurements in docs/performance.md):
`_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu` read 1 / 0.5 byte per weight and beat a
bf16 F.linear at one row, but cost more per extra row; a chunked dequantize + F.linear
(dequantize 512 output rows, which stay in cache, then a bf16 GEMM) costs about the same at any
row count. Up to int8_pack_max_rows / int4_pack_max_rows rows use the packed kernels,
above them the chunked path, except where the native kernels (csrc/) run: int8 on them up to
int8_gemv_max_rows rows (to AMX_INT8_MAX_ROWS on AMX), int4 up to int4_native_max_rows and on
AMX tiles from there to amx_int4_max_rows bf16 rows (see linear_int8_cpu, linear_int4_cpu);
those bounds are per ISA tier, in kernels/crossovers.py.
torch's packed kernels are private ops: each is used only after a probe on this CPU agreed with
the reference (private_ops.verified), else the chunked path runs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from hf_dsinfer.kernels import _dispatch, _native, crossovers
from hf_dsinfer.kernels.linear import bf16_gemm_in_fp32, dot_in_fp32, linear_fp32_chunks
from hf_dsinfer.kernels.private_ops import verified

# How many rows of x each CPU path takes is data per ISA tier: kernels/crossovers.py
# (int8_ / int4_pack_max_rows: torch's packed kernels, then the chunked dequantize + F.linear;
# int8_gemv_max_rows, int4_native_max_rows: the native kernels), measured by
# benchmarks/crossovers.py (the Xeon's first measurements: docs/performance.md).
# Output rows dequantized at a time in the chunked path (512 x 8192 bf16 = 8 MB, cache-resident).
DEQUANT_CHUNK_ROWS = 512
INT4_GROUP_SIZES = (32, 64, 128, 256)


class Int8Weight(NamedTuple):
    qweight: torch.Tensor  # [out, in] int8, or tiles [out // 4, in // 64, 4, 64] when tiled
    scales: torch.Tensor  # [out], dtype of the original weight
    in_scale: torch.Tensor | None = None  # [in] fp32 input-channel equalization, or None
    rowsum: torch.Tensor | None = None  # [out] int32 sum of each row of qweight (native kernel)
    tiled: bool = False


class Int4Weight(NamedTuple):
    packed: torch.Tensor  # [out, in // 2] uint8, two 4-bit values per byte
    scales: torch.Tensor  # [out, in // group_size]
    mins: torch.Tensor  # [out, in // group_size]; W ~ q * scale + min
    group_size: int
    symmetric: bool
    cpu_packed: torch.Tensor | None = None  # torch's int4 CPU layout (this process only)
    cpu_scales_zeros: torch.Tensor | None = None  # [in // group_size, out, 2] (scale, zero)
    tiled: bool = False  # packed holds tiles [out // 4, in // 128, 4, 64]
    act_bits: int = 16  # 8: x quantized to 8 bits per row and group (linear_int4_a8_ref)


# Row tiles (csrc/hfd_simd.h: tile_row): the native kernels stream TILE_ROWS weight rows per
# thread block and read them fastest as one sequential stream, so on CPU an int8 weight or 4-bit
# codes whose shape allows it are stored as [out // 4, row_bytes // 64, 4, 64]: 64 bytes of each
# of 4 rows in turn (int4: codes tiled; scales and mins stay apart, tiling them into the stream
# too was no faster). Measured: docs/performance.md.
TILE_ROWS, TILE_BYTES = 4, 64


def tile_rows(m: torch.Tensor) -> torch.Tensor:
    """[out, row_bytes] (int8 or uint8) -> tiles [out // 4, row_bytes // 64, 4, 64], a copy
    advised for huge pages."""
    n, b = m.shape
    tiles = m.view(n // TILE_ROWS, TILE_ROWS, b // TILE_BYTES, TILE_BYTES)
    return _native.streamed_copy(tiles.transpose(1, 2))


def untile_rows(tiles: torch.Tensor) -> torch.Tensor:
    """Tiles [blocks, chunks, 4, 64] -> the row-major [blocks * 4, chunks * 64] matrix (a copy)."""
    blocks, chunks = tiles.shape[:2]
    return tiles.transpose(1, 2).reshape(blocks * TILE_ROWS, chunks * TILE_BYTES)


def _tiles_fit(m: torch.Tensor, use: str) -> bool:
    """Whether a [out, row_bytes] weight is stored as tiles: on CPU where the native kernels
    for `use` ("gemv": int8, "int4") run, and when its shape is whole tiles (torch's kernels
    read row-major codes, which the native decode layer reads too)."""
    n, b = m.shape
    return (m.device.type == "cpu" and n % TILE_ROWS == 0 and b % TILE_BYTES == 0
            and _native.lib(use) is not None)


def int8_matrix(qweight: Int8Weight) -> torch.Tensor:
    """The [out, in] int8 matrix: qweight itself, or a row-major copy of its tiles."""
    return untile_rows(qweight.qweight) if qweight.tiled else qweight.qweight


def int4_codes(qweight: Int4Weight) -> torch.Tensor:
    """The [out, in // 2] packed codes: packed itself, or a row-major copy of its tiles."""
    if not qweight.tiled:
        return qweight.packed
    return int4_super_order(untile_rows(qweight.packed), inverse=True)


# Bytes of one row's 512-column run that the native int4 kernel reads in an order of its own
# (csrc/hfd_simd.h: int4_order): its 64-byte loads give each of 16 dword lanes 8 columns of
# one 32-column run, the same run in all 4 loads, so a lane's 32 products are summed as
# integers and scaled once per run instead of once per load (~11 vector ops per 64 bytes and
# row instead of ~16). Measured: docs/performance.md.
INT4_SUPER_BYTES = 256


def int4_super_order(packed: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Packed codes [out, row_bytes] with each whole 256-byte run of a row reordered from
    [16][4][4] to [4][16][4] bytes (inverse: back); bytes past the last whole run stay put.
    Rows without a whole run: `packed` itself."""
    n, b = packed.shape
    runs = b // INT4_SUPER_BYTES
    if runs == 0:
        return packed
    head = packed[:, :runs * INT4_SUPER_BYTES].reshape(n, runs, 16, 4, 4)
    if inverse:  # stored [i][j][b] -> row [j][i][b]
        head = head.reshape(n, runs, 4, 16, 4)
    head = head.transpose(2, 3).reshape(n, runs * INT4_SUPER_BYTES)
    return torch.cat([head, packed[:, runs * INT4_SUPER_BYTES:]], dim=1)


# ----------------------------------------------------------------------------------------------
# int8: quantize / reference
# ----------------------------------------------------------------------------------------------


def quantize_int8(weight: torch.Tensor, equalize: bool = False) -> Int8Weight:
    """Symmetric per-output-channel int8 (absmax / 127), scales in the weight's dtype.

    equalize=True first divides every input column k by in_scale[k] = sqrt(max_o |W[o, k]|)
    (AWQ/SmoothQuant-style equalization, weight-only): a few large columns no longer set every
    row's absmax, so the other columns keep more of their 255 levels. The matmul then runs on
    x * in_scale, an [in]-vector multiply. On SmolLM2-135M it took the perplexity gap of int8
    from +1.1% to +0.1% (tests/integration/test_quant_quality.py).
    """
    w = weight.detach().float()  # [out, in]
    in_scale = None
    if equalize:
        in_scale = w.abs().amax(dim=0).sqrt().clamp(min=1e-4)  # [in]
        w = w / in_scale
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-10).to(weight.dtype)  # [out]
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    rowsum = q.sum(dim=1, dtype=torch.int32) if q.device.type == "cpu" else None
    if _tiles_fit(q, "gemv"):
        return Int8Weight(tile_rows(q), scales, in_scale, rowsum, tiled=True)
    q = _native.streamed_copy(q) if q.device.type == "cpu" else q.contiguous()
    return Int8Weight(q, scales, in_scale, rowsum)


def dequantize_int8(qweight: Int8Weight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[out, in] weight q * scale (* in_scale) in `dtype` (default: the scales' dtype), in fp32."""
    w = int8_matrix(qweight).float() * qweight.scales.float()[:, None]
    if qweight.in_scale is not None:
        w = w * qweight.in_scale
    return w.to(dtype or qweight.scales.dtype)


def linear_int8_ref(x: torch.Tensor, qweight: Int8Weight, bias: torch.Tensor | None = None):
    """Dequantize to x.dtype, then nn.Linear's F.linear."""
    return F.linear(x, dequantize_int8(qweight, x.dtype), bias)


# ----------------------------------------------------------------------------------------------
# int4: quantize / reference
# ----------------------------------------------------------------------------------------------


def _check_int4_shape(weight: torch.Tensor, group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(
            f"quantize_int4: group_size must be one of {INT4_GROUP_SIZES}, got {group_size}. "
            "Fix: pass group_size=64 or 128."
        )
    if weight.dim() != 2 or weight.shape[1] % group_size:
        raise ValueError(
            f"quantize_int4: expected a 2-D weight [out, in] with in divisible by group_size="
            f"{group_size}, got shape {tuple(weight.shape)}. Fix: pick a group size dividing "
            "in, or zero-pad the input dim (and x) to a multiple of it."
        )


def _int4_scales_mins(wg: torch.Tensor, symmetric: bool, dtype: torch.dtype):
    """Per-group scale and min (rounded to `dtype`) for grouped fp32 weights [out, G, group]."""
    if symmetric:
        scales = (wg.abs().amax(dim=-1) / 7.0).clamp(min=1e-10).to(dtype)  # [out, G]
        return scales, (-8.0 * scales.float()).to(dtype)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)  # [out, G]
    scales = ((hi - lo) / 15.0).clamp(min=1e-10).to(dtype)
    return scales, lo.to(dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[..., 2n] values in [0, 15] -> [..., n] uint8, even index in the low nibble."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] uint8 -> [..., 2n] uint8 values in [0, 15] (inverse of pack_int4)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def _torch_int4_copy(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor):
    """codes q [out, in] (values 0-15) as torch's int4 CPU kernel takes them, through torch's
    own conversion (its layout is opaque here): packed codes, and (scale, zero) pairs
    [G, out, 2], as that kernel computes W = (q - 8) * scale + zero per group."""
    cpu_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    zeros = (mins.float() + 8.0 * scales.float()).to(scales.dtype)  # [out, G]
    scales_zeros = torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous()  # [G,out,2]
    return cpu_packed, scales_zeros


def probe_private_ops(bits: int, dtype: torch.dtype) -> None:
    """Run now, eagerly, the probe of the private op that CPU linears of `bits` consult for
    activations of `dtype`, so that a first call under torch.compile finds the verdict (the
    probe runs outside the graph, a graph break that fullgraph=True refuses)."""
    if bits == 8:
        verified(INT8PACK_MM, dtype, _probe_int8pack_mm)
    else:
        verified(INT4PACK_MM, dtype, _probe_int4pack_mm)


def _cpu_int4_layout(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor):
    """_torch_int4_copy where torch's kernel takes the shape and passed its probe, else Nones."""
    if (q.device.type != "cpu" or q.shape[0] % 16
            or not verified(INT4PACK_MM, scales.dtype, _probe_int4pack_mm)):
        return None, None
    return _torch_int4_copy(q, scales, mins)


def quantize_int4(
    weight: torch.Tensor, group_size: int = 128, symmetric: bool = False,
    portable: bool = False,
) -> Int4Weight:
    """4-bit group-wise quantization of a [out, in] weight (see the module docstring).

    By default the codes are stored as the native kernels' tiles where those run, else
    row-major with a second copy in torch's int4 CPU layout (cpu_packed) for its kernel.
    portable=True: row-major codes [out, in // 2] and nothing else, bytes that mean the same
    on every CPU, with or without the native kernels (the offload engine stores these; the
    native kernel and the reference read them as they are)."""
    _check_int4_shape(weight, group_size)
    out_f, in_f = weight.shape
    wg = weight.detach().float().reshape(out_f, in_f // group_size, group_size)  # [out, G, g]
    scales, mins = _int4_scales_mins(wg, symmetric, weight.dtype)
    q = torch.round((wg - mins.float()[..., None]) / scales.float()[..., None]).clamp(0, 15)
    q = q.reshape(out_f, in_f).to(torch.uint8)  # [out, in]
    packed = pack_int4(q)
    if portable:
        return Int4Weight(packed, scales, mins, group_size, symmetric)
    tiled = _tiles_fit(packed, "int4")
    cpu_packed = cpu_scales_zeros = None
    if not tiled:
        cpu_packed, cpu_scales_zeros = _cpu_int4_layout(q, scales, mins)
    stored = tile_rows(int4_super_order(packed)) if tiled else packed
    return Int4Weight(stored, scales, mins, group_size, symmetric, cpu_packed, cpu_scales_zeros,
                      tiled)


def _dequantize_int4_rows(packed, scales, mins, group_size: int, dtype: torch.dtype):
    out_f = packed.shape[0]
    q = unpack_int4(packed).float().reshape(out_f, -1, group_size)  # [out, G, g]
    w = q * scales.float()[..., None] + mins.float()[..., None]
    return w.reshape(out_f, -1).to(dtype)


def dequantize_int4(qweight: Int4Weight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[out, in] weight q * scale + min in `dtype` (default: the scales' dtype), fp32 math."""
    return _dequantize_int4_rows(int4_codes(qweight), qweight.scales, qweight.mins,
                                 qweight.group_size, dtype or qweight.scales.dtype)


def linear_int4_ref(x: torch.Tensor, qweight: Int4Weight, bias: torch.Tensor | None = None):
    """Dequantize to x.dtype, then F.linear."""
    return F.linear(x, dequantize_int4(qweight, x.dtype), bias)


# ----------------------------------------------------------------------------------------------
# Triton dequant-matmul kernels
# ----------------------------------------------------------------------------------------------


def quantize_activations_int8(x2: torch.Tensor, group_size: int):
    """Rows of x [M, in] as 8-bit codes per group of `group_size` columns (the weight's groups):
    (codes [M, G, group] fp32 integers in [-127, 127], unit [M, G], gsum [M, G]), all fp32:
    unit = absmax / 127, codes = round-half-even(x * (127 / absmax)), 0 for an all-zero group;
    gsum is the group's fp32 sum of x (the weight's mins meet x itself)."""
    m, k = x2.shape
    xg = x2.float().reshape(m, k // group_size, group_size)
    amax = xg.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    codes = torch.round(xg * inv[..., None]).clamp(-127, 127)
    return codes, amax / 127.0, xg.sum(-1)


def linear_int4_a8_ref(x: torch.Tensor, qweight: Int4Weight, bias: torch.Tensor | None = None):
    """W4A8: x quantized per row and group to 8 bits (quantize_activations_int8), times the 4-bit
    codes centred (code - 8) in exact integer sums per group (fp32 holds them exactly: |sum| <
    2^19), each group's sum scaled by scale * unit, min + 8 * scale times the group sums of x;
    rounded to x's dtype, then the bias. csrc/cpu_qgemm.c's hfd_int4_gemm_a8 computes the same
    up to the order of the fp32 sums over groups."""
    g = qweight.group_size
    x2 = x.reshape(-1, x.shape[-1])
    codes, unit, gsum = quantize_activations_int8(x2, g)
    n = qweight.scales.shape[0]
    w = unpack_int4(int4_codes(qweight)).float().reshape(n, -1, g)  # [N, G, g]
    sums = torch.einsum("mgk,ngk->mng", codes, w - 8)  # exact integers, the codes centred
    scales = qweight.scales.float()
    scale = scales[None] * unit[:, None, :]  # [M, N, G]
    y = (sums * scale).sum(-1) + gsum @ (qweight.mins.float() + 8 * scales).T
    y = y.to(x.dtype)
    y = y if bias is None else y + bias
    return y.reshape(*x.shape[:-1], n)


@functools.lru_cache(maxsize=1)
def _kernels():
    """Import Triton and define the kernels on first use (the module imports without Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _linear_int8_kernel(
        x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_ym,
        HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # acc = x @ q.T in fp32 over int8 tiles converted in registers; the per-output-channel
        # scale factors out of the K sum, so it is applied once to the accumulator.
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x_mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
            xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask,
                         other=0.0)
            q_mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
            qt = tl.load(q_ptr + offs_n[None, :] * stride_qn + offs_k[:, None], mask=q_mask,
                         other=0)  # [BLOCK_K, BLOCK_N] int8
            if DOT_FP32:
                acc += tl.dot(xt.to(tl.float32), qt.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(xt, qt.to(xt.dtype))
        acc *= tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        y_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=y_mask)

    @triton.jit
    def _linear_int4_kernel(
        x_ptr, p_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_pn, stride_sn,
        stride_ym, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # BLOCK_K divides GROUP, so one K tile lies in one group: one scale/min per column.
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x_mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
            xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask,
                         other=0.0)
            p_mask = (offs_k[:, None] < K) & n_mask[None, :]
            byte = tl.load(p_ptr + offs_n[None, :] * stride_pn + offs_k[:, None] // 2,
                           mask=p_mask, other=0)  # [BLOCK_K, BLOCK_N] uint8
            q = ((byte >> ((offs_k[:, None] % 2) * 4).to(tl.uint8)) & 0xF).to(tl.float32)
            g_off = offs_n * stride_sn + k0 // GROUP
            scale = tl.load(s_ptr + g_off, mask=n_mask, other=0.0).to(tl.float32)
            low = tl.load(z_ptr + g_off, mask=n_mask, other=0.0).to(tl.float32)
            wt = q * scale[None, :] + low[None, :]  # dequantized weight.T tile, fp32
            if DOT_FP32:
                acc += tl.dot(xt.to(tl.float32), wt, input_precision="ieee")
            else:
                acc += tl.dot(xt, wt.to(xt.dtype))
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y_mask = (offs_m[:, None] < M) & n_mask[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=y_mask)

    return triton, _linear_int8_kernel, _linear_int4_kernel


def _launch_shape(x: torch.Tensor, n: int):
    """x as contiguous rows [M, in], the output [M, out] and the (M, N) grid for 16x64 tiles."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # [M, in]
    y = torch.empty(x2.shape[0], n, device=x.device, dtype=x.dtype)  # [M, out]
    grid = ((x2.shape[0] + 15) // 16, (n + 63) // 64)
    return x2, y, grid


def linear_int8_triton(x: torch.Tensor, qweight: Int8Weight, bias: torch.Tensor | None = None):
    """Fused int8 dequant-matmul: reads 1 byte per weight, fp32 accumulation."""
    _, kernel, _ = _kernels()
    q = int8_matrix(qweight).contiguous()
    n, k = q.shape
    x2, y, grid = _launch_shape(x, n)
    b = bias if bias is not None else y
    kernel[grid](x2, q, qweight.scales, b, y, x2.shape[0], n, k, x2.stride(0), q.stride(0),
                 y.stride(0), HAS_BIAS=bias is not None, DOT_FP32=dot_in_fp32(x.dtype),
                 BLOCK_M=16, BLOCK_N=64, BLOCK_K=32)
    return y.reshape(*x.shape[:-1], n)


def linear_int4_triton(x: torch.Tensor, qweight: Int4Weight, bias: torch.Tensor | None = None):
    """Fused int4 dequant-matmul: unpacks nibbles and applies scale/min in registers."""
    _, _, kernel = _kernels()
    p, s, z = int4_codes(qweight), qweight.scales.contiguous(), qweight.mins.contiguous()
    n, k = p.shape[0], p.shape[1] * 2
    x2, y, grid = _launch_shape(x, n)
    b = bias if bias is not None else y
    kernel[grid](x2, p, s, z, b, y, x2.shape[0], n, k, x2.stride(0), p.stride(0), s.stride(0),
                 y.stride(0), GROUP=qweight.group_size, HAS_BIAS=bias is not None,
                 DOT_FP32=dot_in_fp32(x.dtype), BLOCK_M=16, BLOCK_N=64, BLOCK_K=32)
    return y.reshape(*x.shape[:-1], n)


# ----------------------------------------------------------------------------------------------
# CPU fast paths
# ----------------------------------------------------------------------------------------------


def _chunked_dequant_linear(x2: torch.Tensor, n: int, dequant_rows, bias) -> torch.Tensor:
    """y = x2 @ W.T with W dequantized DEQUANT_CHUNK_ROWS output rows at a time (in cache); for
    many bf16 rows on a CPU without bf16 dot products, the dequantized bf16 rows go through
    fp32 GEMMs instead (kernels/linear.py: bf16_gemm_in_fp32), the same numerics."""
    if bf16_gemm_in_fp32(x2, x2.shape[0]) and (bias is None or bias.dtype == torch.bfloat16):
        return linear_fp32_chunks(x2, n, dequant_rows, bias)
    y = torch.empty(x2.shape[0], n, dtype=x2.dtype, device=x2.device)  # [M, out]
    for start in range(0, n, DEQUANT_CHUNK_ROWS):
        stop = min(start + DEQUANT_CHUNK_ROWS, n)
        w = dequant_rows(start, stop)  # [chunk, in] in x.dtype
        b = bias[start:stop] if bias is not None else None
        y[:, start:stop] = F.linear(x2, w, b)
    return y


def _native_dequant_lib(dtype: torch.dtype, *tensors: torch.Tensor | None):
    """The native library when its dequantization takes these (CPU, contiguous, known dtypes)."""
    codes = _native.DTYPE_CODES
    if dtype not in codes or any(t is not None and (t.device.type != "cpu" or not t.is_contiguous())
                                 for t in tensors):
        return None
    return _native.lib("dequantize")


def _int8_rows(qweight: Int8Weight, dtype: torch.dtype, start: int, stop: int) -> torch.Tensor:
    q, scales, in_scale = qweight.qweight, qweight.scales, qweight.in_scale
    k = _int8_in_features(qweight)
    lib = _native_dequant_lib(dtype, q, scales, in_scale)
    if (lib is not None and k % 16 == 0 and scales.dtype in _native.DTYPE_CODES
            and (in_scale is None or in_scale.dtype == torch.float32)):
        out = torch.empty(stop - start, k, dtype=dtype)
        codes = _native.DTYPE_CODES
        lib.hfd_dequant_int8_rows(q.data_ptr(), scales.data_ptr(), codes[scales.dtype],
                                  None if in_scale is None else in_scale.data_ptr(), k,
                                  start, stop, out.data_ptr(), codes[dtype], int(qweight.tiled),
                                  torch.get_num_threads())
        return out
    rows = int8_matrix(qweight)[start:stop]
    return dequantize_int8(Int8Weight(rows, scales[start:stop], in_scale), dtype)


def _int8_in_features(qweight: Int8Weight) -> int:
    q = qweight.qweight
    return q.shape[1] * TILE_BYTES if qweight.tiled else q.shape[1]


def dequantize_int4_rows(qweight: Int4Weight, dtype: torch.dtype, start: int,
                         stop: int) -> torch.Tensor:
    """Output rows [start, stop) of the weight, [rows, in] in `dtype`: dequantize_int4's
    numerics, by the native kernel where it runs."""
    packed, scales, mins = qweight.packed, qweight.scales, qweight.mins
    lib = _native_dequant_lib(dtype, packed, scales, mins)
    if lib is not None and scales.dtype in _native.DTYPE_CODES and mins.dtype == scales.dtype:
        k = scales.shape[1] * qweight.group_size
        out = torch.empty(stop - start, k, dtype=dtype)
        lib.hfd_dequant_int4_rows(packed.data_ptr(), scales.data_ptr(), mins.data_ptr(),
                                  _native.DTYPE_CODES[scales.dtype], qweight.group_size, k, start,
                                  stop, out.data_ptr(), _native.DTYPE_CODES[dtype],
                                  int(qweight.tiled), torch.get_num_threads())
        return out
    return _dequantize_int4_rows(int4_codes(qweight)[start:stop], scales[start:stop],
                                 mins[start:stop], qweight.group_size, dtype)


def _fold_in_scale(x: torch.Tensor, qweight: Int8Weight) -> tuple[torch.Tensor, Int8Weight]:
    """x @ (q * s * in_scale).T == (x * in_scale) @ (q * s).T: for kernels that take plain int8."""
    if qweight.in_scale is None:
        return x, qweight
    return (x.float() * qweight.in_scale).to(x.dtype), qweight._replace(in_scale=None)


def _native_int8(lib, x2: torch.Tensor, qweight: Int8Weight, bias: torch.Tensor | None):
    q, scales, in_scale = qweight.qweight, qweight.scales, qweight.in_scale
    m, k = x2.shape
    n = scales.shape[0]
    codes = _native.DTYPE_CODES
    y = torch.empty(m, n, dtype=x2.dtype)
    code = lib.hfd_int8_gemv(
        x2.data_ptr(), codes[x2.dtype], None if in_scale is None else in_scale.data_ptr(),
        q.data_ptr(), qweight.rowsum.data_ptr(), scales.data_ptr(), codes[scales.dtype],
        None if bias is None else bias.data_ptr(), 0 if bias is None else codes[bias.dtype],
        y.data_ptr(), m, n, k, int(qweight.tiled), torch.get_num_threads())
    if code:
        _native.check(code, "hfd_int8_gemv")
    return y


def _native_int8_lib(x2: torch.Tensor, qweight: Int8Weight, bias: torch.Tensor | None):
    """The native library when its kernel takes this call, else None (the weight-side checks
    hold by construction: quantize_int8 makes rowsum and contiguous int8 rows on CPU)."""
    dtypes = _native.DTYPE_CODES
    fits = (x2.shape[0] <= crossovers.rows().int8_gemv_max_rows and qweight.rowsum is not None
            and x2.dtype in dtypes and qweight.scales.dtype in dtypes
            and (bias is None or (bias.dtype in dtypes and bias.is_contiguous())))
    return _native.lib("gemv") if fits else None


# Rows of x from which an int8 linear runs on AMX-INT8 tiles (csrc/cpu_moe.c: hfd_int8_amx,
# the native GEMV's numerics to the bit) where the CPU has them, and up to which (above, the
# chunked dequantize + oneDNN GEMM is faster: each 16-row weight block reads every row's x
# planes, 3 bytes per element, which leave L2 at some hundreds of rows). crossovers.XEON holds
# the bounds; the amx tier is the only one with AMX. Measured: docs/performance.md.
AMX_INT8_MIN_ROWS = crossovers.TABLE["amx"].amx_int8_min_rows
AMX_INT8_MAX_ROWS = crossovers.TABLE["amx"].amx_int8_max_rows


def _native_int8_amx(x2: torch.Tensor, qweight: Int8Weight, bias: torch.Tensor | None):
    """x2 [M, in] times the weight on AMX-INT8 tiles (with the bias, in x's dtype), or None
    where that kernel does not run (too few rows, no AMX-INT8, row-major codes, shapes)."""
    dtypes = _native.DTYPE_CODES
    if (not AMX_INT8_MIN_ROWS <= x2.shape[0] <= AMX_INT8_MAX_ROWS or not qweight.tiled
            or qweight.rowsum is None
            or x2.dtype not in dtypes or qweight.scales.dtype not in dtypes
            or (qweight.in_scale is not None and qweight.in_scale.dtype != torch.float32)
            or (bias is not None and (bias.dtype not in dtypes or not bias.is_contiguous()))
            or not _native.amx_int8_available()):
        return None
    lib = _native.lib()
    q, scales, in_scale = qweight.qweight, qweight.scales, qweight.in_scale
    m, k = x2.shape
    n = scales.shape[0]
    y = torch.empty(m, n, dtype=x2.dtype)
    code = lib.hfd_int8_amx(
        x2.data_ptr(), dtypes[x2.dtype], None if in_scale is None else in_scale.data_ptr(),
        q.data_ptr(), qweight.rowsum.data_ptr(), scales.data_ptr(), dtypes[scales.dtype],
        None if bias is None else bias.data_ptr(), 0 if bias is None else dtypes[bias.dtype],
        y.data_ptr(), m, n, k, torch.get_num_threads())
    if code == -3:
        return None
    _native.check(code, "hfd_int8_amx")
    return y


def _fp32_product(lib, name: str, m: int, n: int, *args) -> torch.Tensor | None:
    """y [m, n] fp32 from the native kernel `name`, called with args, then y and the thread
    count (hfd_int4_linear, hfd_int4_gemm_bf16, hfd_int8_gemm_bf16 all end so); None for a
    shape the kernel does not take (-3)."""
    y = torch.empty(m, n, dtype=torch.float32)
    code = getattr(lib, name)(*args, y.data_ptr(), torch.get_num_threads())
    if code == -3:
        return None
    _native.check(code, name)
    return y


def _native_int8_gemm(x2: torch.Tensor, qweight: Int8Weight) -> torch.Tensor | None:
    """x2 [M, in] (bf16, the input scale already folded in) times the int8 weight by
    csrc/cpu_qgemm.c's hfd_int8_gemm_bf16 in fp32: panels of weight rows dequantized to bf16 in
    cache (F.linear on dequantize_int8(W, bf16) up to the order of the fp32 sums). None where it
    does not run: no library for "panel" (_native.MIN_TIER), x not bf16, an input
    scale left, or a shape it does not take (out % 16, in % 32)."""
    lib, dtypes = _native.lib("panel"), _native.DTYPE_CODES
    q, scales = qweight.qweight, qweight.scales
    if (lib is None or x2.device.type != "cpu" or x2.dtype != torch.bfloat16
            or qweight.in_scale is not None or scales.dtype not in dtypes
            or not (scales.is_contiguous() and q.is_contiguous())):
        return None
    m, k = x2.shape
    n = scales.shape[0]
    return _fp32_product(lib, "hfd_int8_gemm_bf16", m, n, x2.data_ptr(), m, q.data_ptr(),
                         scales.data_ptr(), dtypes[scales.dtype], n, k, int(qweight.tiled))


def linear_int8_cpu(x: torch.Tensor, qweight: Int8Weight, bias: torch.Tensor | None = None):
    """AMX_INT8_MIN_ROWS to AMX_INT8_MAX_ROWS rows: the AMX-INT8 kernel where it runs; else the
    native GEMV up to int8_gemv_max_rows rows where it runs; else, up to int8_gemm_max_rows bf16
    rows, the native kernel that dequantizes panels of the weight in cache (where the tier has
    that bound; the product rounded to bf16, then the bias added); else torch's
    _weight_int8pack_mm up to int8_pack_max_rows rows where it passed its probe (on a row-major
    copy of tiles: the same numerics whichever layout the weight has), else chunked dequantize
    + GEMM."""
    n = qweight.scales.shape[0]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # [M, in]
    y = _native_int8_amx(x2, qweight, bias)
    if y is not None:
        return y.reshape(*x.shape[:-1], n)
    lib = _native_int8_lib(x2, qweight, bias)
    if lib is not None:
        return _native_int8(lib, x2, qweight, bias).reshape(*x.shape[:-1], n)
    x2, qweight = _fold_in_scale(x2, qweight)  # torch's kernels take plain int8
    most = crossovers.rows().int8_gemm_max_rows
    if most is not None and x2.shape[0] <= most:
        y = _native_int8_gemm(x2, qweight)
        if y is not None:
            y = y.to(x.dtype)
            return (y if bias is None else y + bias).reshape(*x.shape[:-1], n)
    # torch's int8 CPU kernel reads the input dim 16 at a time: other sizes crash the process
    if (x2.shape[0] <= crossovers.rows().int8_pack_max_rows and x2.shape[1] % 16 == 0
            and verified(INT8PACK_MM, x.dtype, _probe_int8pack_mm)):
        # The kernel wants scales in x.dtype; the cast is of an [out] vector.
        q = int8_matrix(qweight).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(x2, q, qweight.scales.to(x.dtype))
        y = y if bias is None else y + bias
    else:
        rows = functools.partial(_int8_rows, qweight, x.dtype)
        y = _chunked_dequant_linear(x2, n, rows, bias)
    return y.reshape(*x.shape[:-1], n)


# torch's private packed kernels, used as black boxes once a probe agreed (private_ops.py)
INT8PACK_MM = "aten._weight_int8pack_mm"
INT4PACK_MM = "aten._weight_int4pack_mm_for_cpu"  # after _convert_weight_to_int4pack_for_cpu


def _probe_operands(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed weight [80, 256] and x [3, 256] for the probes: 80 output rows (a partial block of
    torch's 64-row int4 layout), in % 16 == 0 (what _weight_int8pack_mm needs), 8 groups of 32."""
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(80, 256, generator=gen).to(dtype),
            torch.randn(3, 256, generator=gen).to(dtype))


def _probe_int8pack_mm(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    w, x = _probe_operands(dtype)
    qw = quantize_int8(w)
    q = int8_matrix(qw).contiguous()
    return torch.ops.aten._weight_int8pack_mm(x, q, qw.scales), linear_int8_ref(x, qw)


def _probe_int4pack_mm(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    w, x = _probe_operands(dtype)
    qw = quantize_int4(w, 32, portable=True)  # no torch copy: that would ask for this probe
    cpu_packed, scales_zeros = _torch_int4_copy(unpack_int4(qw.packed), qw.scales, qw.mins)
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, cpu_packed, 32, scales_zeros)
    return got, linear_int4_ref(x, qw)


def _native_int4(x2: torch.Tensor, qweight: Int4Weight) -> torch.Tensor | None:
    """x2 [M, in] times the weight by the native int4 kernel (csrc/cpu_decode.c:
    hfd_int4_linear) in fp32, or None where it does not run (no library, dtypes or shapes it
    does not take). Where torch's int4 kernel has a copy of these codes, only from the tier
    where this kernel is the faster (_native.MIN_TIER["int4"]); else (tiles, the offload
    engine's row-major codes) at any tier: the alternative is dequantize + GEMM."""
    use = "int4" if qweight.cpu_packed is not None else "codes"
    lib, dtypes = _native.lib(use), _native.DTYPE_CODES
    scales, mins = qweight.scales, qweight.mins
    if (lib is None or x2.device.type != "cpu" or x2.dtype not in dtypes
            or scales.dtype not in dtypes or mins.dtype != scales.dtype
            or not (scales.is_contiguous() and mins.is_contiguous())):
        return None
    m, k = x2.shape
    n = scales.shape[0]
    return _fp32_product(lib, "hfd_int4_linear", m, n, x2.data_ptr(), dtypes[x2.dtype], m,
                         qweight.packed.data_ptr(), scales.data_ptr(), mins.data_ptr(),
                         dtypes[scales.dtype], qweight.group_size, n, k, int(qweight.tiled))



def _native_int4_gemm(x2: torch.Tensor, qweight: Int4Weight) -> torch.Tensor | None:
    """x2 [M, in] (bf16) times the weight by csrc/cpu_qgemm.c's hfd_int4_gemm_bf16 in fp32: a
    panel of weight rows dequantized to bf16 in cache at a time, every row of x multiplied with
    it there (F.linear on dequantize_int4(W, bf16) up to the order of the fp32 sums). None where
    it does not run: no library for "panel" (_native.MIN_TIER), x not bf16, or a shape it
    does not take (out % 16, group % 32)."""
    lib, dtypes = _native.lib("panel"), _native.DTYPE_CODES
    scales, mins = qweight.scales, qweight.mins
    if (lib is None or x2.device.type != "cpu" or x2.dtype != torch.bfloat16
            or scales.dtype not in dtypes or mins.dtype != scales.dtype
            or not (scales.is_contiguous() and mins.is_contiguous()
                    and qweight.packed.is_contiguous())):
        return None
    m, k = x2.shape
    n = scales.shape[0]
    return _fp32_product(lib, "hfd_int4_gemm_bf16", m, n, x2.data_ptr(), m,
                         qweight.packed.data_ptr(), scales.data_ptr(), mins.data_ptr(),
                         dtypes[scales.dtype], qweight.group_size, n, k, int(qweight.tiled))


def _native_int4_amx(x2: torch.Tensor, qweight: Int4Weight) -> torch.Tensor | None:
    """x2 [M, in] (bf16) times the weight on AMX-BF16 tiles (csrc/cpu_moe.c: hfd_int4_amx), a
    32-row panel of the weight dequantized to bf16 in cache at a time: F.linear(x2,
    dequantize_int4(W, bf16)) rounded once to bf16, the sums in the tiles' order (oneDNN's own
    on this CPU up to some tens of rows: the same bits). None where it does not run: no AMX
    granted (or settings amx=False), x not bf16, or a shape it does not take (out % 32, group
    % 32)."""
    scales, mins = qweight.scales, qweight.mins
    dtypes = _native.DTYPE_CODES
    if (x2.device.type != "cpu" or x2.dtype != torch.bfloat16 or scales.dtype not in dtypes
            or mins.dtype != scales.dtype
            or not (scales.is_contiguous() and mins.is_contiguous()
                    and qweight.packed.is_contiguous())
            or not _native.amx_available()):
        return None
    m, k = x2.shape
    n = scales.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    code = _native.lib().hfd_int4_amx(
        x2.data_ptr(), m, qweight.packed.data_ptr(), scales.data_ptr(), mins.data_ptr(),
        dtypes[scales.dtype], qweight.group_size, n, k, int(qweight.tiled), y.data_ptr(),
        torch.get_num_threads())
    if code == -3:
        return None
    _native.check(code, "hfd_int4_amx")
    return y


def linear_int4_a8_cpu(x: torch.Tensor, qweight: Int4Weight, bias: torch.Tensor | None = None):
    """linear_int4_a8_ref's numbers by csrc/cpu_qgemm.c's hfd_int4_gemm_a8 where it runs (the
    "a8" use of _native.MIN_TIER; x fp32 / bf16 / fp16; out features a multiple of 16), that
    reference otherwise; up to the tier's a8_rows_max_rows rows (kernels/crossovers.py) by
    csrc/cpu_decode.c's hfd_int4_a8_rows, the batch-1 kernel, which gives the panel kernel's
    bits. So every row count gets the same numbers, and a row's result does not depend on the
    rows beside it (a request's tokens under continuous batching do not depend on its
    neighbours)."""
    lib, dtypes = _native.lib("a8"), _native.DTYPE_CODES
    scales, mins, n = qweight.scales, qweight.mins, qweight.scales.shape[0]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = None
    if (lib is not None and x2.device.type == "cpu" and x2.dtype in dtypes
            and scales.dtype in dtypes and mins.dtype == scales.dtype
            and scales.is_contiguous() and mins.is_contiguous()
            and qweight.packed.is_contiguous()):
        m, k = x2.shape
        args = (m, n, x2.data_ptr(), dtypes[x2.dtype], m, qweight.packed.data_ptr(),
                scales.data_ptr(), mins.data_ptr(), dtypes[scales.dtype], qweight.group_size, n,
                k, int(qweight.tiled))
        if m <= crossovers.rows().a8_rows_max_rows and n % 16 == 0:  # where the panel
            # kernel would take it: the same bits at every row count
            y = _fp32_product(lib, "hfd_int4_a8_rows", *args)
        if y is None:
            y = _fp32_product(lib, "hfd_int4_gemm_a8", *args)
    if y is None:
        return linear_int4_a8_ref(x, qweight, bias)
    y = y.to(x.dtype)
    y = y if bias is None else y + bias
    return y.reshape(*x.shape[:-1], n)


def linear_int4_cpu(x: torch.Tensor, qweight: Int4Weight, bias: torch.Tensor | None = None):
    """Up to int4_native_max_rows rows the native int4 kernel where it runs (it reads the codes
    as stored, tiles or row-major); then, up to amx_int4_max_rows bf16 rows (the amx tier), the
    AMX kernel where the CPU grants the tiles; else, up to int4_gemm_max_rows bf16 rows, the
    native kernel that dequantizes panels of the weight in cache (where the tier has that
    bound); else, up to
    int4_pack_max_rows rows (kernels/crossovers.py), _weight_int4pack_mm_for_cpu on torch's
    layout where the weight has it and that kernel passed its probe for x's dtype; chunked
    dequantize + GEMM otherwise. The product is rounded to x's dtype, then the bias added, as
    torch's kernel and nn.Linear order it."""
    n, g = qweight.scales.shape[0], qweight.group_size
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # [M, in]
    bounds = crossovers.rows()  # of this tier
    rows = x2.shape[0]
    y = None
    if rows <= bounds.int4_native_max_rows:
        y = _native_int4(x2, qweight)
    elif bounds.amx_int4_max_rows is not None and rows <= bounds.amx_int4_max_rows:
        y = _native_int4_amx(x2, qweight)  # bf16 already
    if y is None and rows > bounds.int4_native_max_rows and (
            bounds.int4_gemm_max_rows is not None and rows <= bounds.int4_gemm_max_rows):
        y = _native_int4_gemm(x2, qweight)
    if y is not None:
        y = y.to(x.dtype)
        y = y if bias is None else y + bias
    elif (rows <= bounds.int4_pack_max_rows and qweight.cpu_packed is not None
          and verified(INT4PACK_MM, x.dtype, _probe_int4pack_mm)):
        sz = qweight.cpu_scales_zeros.to(x.dtype)  # no-op when x has the weight's dtype
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, qweight.cpu_packed, g, sz)
        y = y if bias is None else y + bias
    else:
        rows_of = functools.partial(dequantize_int4_rows, qweight, x.dtype)
        y = _chunked_dequant_linear(x2, n, rows_of, bias)
    return y.reshape(*x.shape[:-1], n)


# ----------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------


def linear_int8(
    x: torch.Tensor,
    qweight: Int8Weight,
    bias: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """y = x @ dequantize_int8(qweight).T + bias, computed by the backend's int8 kernel."""
    fn = _dispatch.pick(backend, x.device, ref=linear_int8_ref, triton_fn=linear_int8_triton,
                        cpu_fn=linear_int8_cpu)
    fn = _many_rows_on_cublas(fn, linear_int8_triton, linear_int8_ref, x, backend)
    if fn is linear_int8_triton:  # the CPU path folds in_scale itself (or the native kernel)
        x, qweight = _fold_in_scale(x, qweight)
    return fn(x, qweight, bias)


def linear_int4(
    x: torch.Tensor,
    qweight: Int4Weight,
    bias: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """y = x @ dequantize_int4(qweight).T + bias, computed by the backend's int4 kernel; with
    qweight.act_bits == 8, x quantized to 8 bits first (linear_int4_a8_ref's numbers: the
    native kernel on CPU where it runs, that reference elsewhere)."""
    if qweight.act_bits == 8:
        fn = _dispatch.pick(backend, x.device, ref=linear_int4_a8_ref,
                            cpu_fn=linear_int4_a8_cpu)
        return fn(x, qweight, bias)
    fn = _dispatch.pick(backend, x.device, ref=linear_int4_ref, triton_fn=linear_int4_triton,
                        cpu_fn=linear_int4_cpu)
    fn = _many_rows_on_cublas(fn, linear_int4_triton, linear_int4_ref, x, backend)
    return fn(x, qweight, bias)


# Rows of x above which a CUDA call that did not name the Triton backend dequantizes and runs
# cuBLAS (the reference) instead of the Triton int8 / int4 kernels. On an H200 (docs/gpu.md)
# Llama-1.1B's prefill of 16 x 128 rows took 172 ms with the int4 kernel and 47 ms with the
# int8 one, against 28 ms for the bf16 model on cuBLAS; decode steps of 1 and 16 rows ran level
# with bf16 (int4) or at 0.7x (int8).
TRITON_QUANT_MAX_ROWS = 16


def _many_rows_on_cublas(fn, triton_fn, ref, x: torch.Tensor, backend: str | None):
    if (fn is triton_fn and not _dispatch.triton_named(backend)
            and x.numel() // x.shape[-1] > TRITON_QUANT_MAX_ROWS):
        return ref
    return fn
