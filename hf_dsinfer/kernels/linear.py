"""Linear layer y = x @ weight.T + bias, with a different matrix kernel for small and large batch.

This is DeepSpeed-Inference's "SBI-GeMM" idea: at decode time (one or a few token rows) a linear
is a matrix-vector product bound by the bandwidth of reading the weight once, so it wants a GEMV
kernel that streams the weight row by row; at prefill (many rows) it is compute bound and wants a
tiled GEMM that reuses each weight tile across many rows.

Shapes and layouts:
    x       [..., in]      any leading dims; flattened to M = prod(leading) rows
    weight  [out, in]      may be a non-contiguous view (GPT-2's Conv1D stores [in, out] and
                           passes `weight.t()`); it is never copied on the hot path
    bias    [out] or None
    out     [..., out]     dtype of x

Numerics: products accumulate in fp32 in every path (F.linear / torch.mv do so for bf16 and
fp16 on CPU; the Triton kernels use an fp32 accumulator) and round once to x.dtype, as HF's
nn.Linear does.

From there to `bf16_gemm_max_rows` rows (batched decode of a few sequences), the native panel
kernel of csrc/cpu_qgemm.c (hfd_gemm_bf16: the same dot products, 6 rows of x by 4 weight rows
in registers; Llama-1.1B's MLP weight on Zen 5, 2 threads: 8 rows 0.66-0.74 ms against
F.linear's 0.83-0.87, 16 rows 0.86-0.89 against 0.99-1.03, level at 32, slower from 64).

CPU fast path: on tiers whose crossover row has `bf16_gemv_max_rows` (Zen 5's AVX-512 BF16,
kernels/crossovers.py), 1 to 4 bf16 rows run the native GEMV of csrc/cpu_experts.c
(hfd_gemv_bf16: vdpbf16ps dot products streaming the row-major weight once; 1024 x 1024 at one
row 86 us against F.linear's 570 and torch.mv's 653 on that machine, 1 thread, loaded; one
rounding as F.linear's, its fp32 sums in another order). Elsewhere one-row bf16 calls with a
row-contiguous weight use `torch.mv`, which streams a
row-major [out, in] bf16 weight faster than `F.linear`; `torch.mv` loses for fp16 and for
column-major weights, ties for fp32, and a loop of `torch.mv` over rows loses to F.linear from
4 rows up (measured: docs/performance.md).

From 2 to CPU_AMX_MAX_ROWS bf16 rows on a CPU with AMX (batched decode, short prefills), the
native kernel of csrc/cpu_moe.c (`hfd_linear_bf16`) reads the row-major weight straight into AMX
tiles, where oneDNN's GEMM reorders it on every call. The 154 linears of a Llama-1.1B-shaped
model (1.94 GB of bf16 weights, cycled past the L3), F.linear vs native, ms: 2 rows 103.6 vs
85.5, 16 rows 110.3 vs 95.7, 64 rows 177.2 vs 104.2, 128 rows 218.7 vs 163.2, 256 rows 340.3 vs
286.4, 512 rows 655.3 vs 625.6, 2048 rows 2024 vs 2307 (oneDNN's blocking wins there). Its
output equalled F.linear's bit for bit on every shape tested (fp32 sums of exact products,
rounded once, bias added before the rounding). Everything else uses F.linear (addmm), which goes
to oneDNN / AMX for large M.
"""

from __future__ import annotations

import functools
import platform

import torch
import torch.nn.functional as F

from hf_dsinfer.kernels import _dispatch, _native, crossovers

# Rows of x up to which the Triton launcher uses the GEMV kernel instead of the tiled GEMM:
# below this a 16-row tl.dot tile is mostly padding and the kernel is bound by weight reads.
GEMV_MAX_ROWS = 4
# Rows of x up to which the CPU path uses torch.mv (see the module docstring for why 1).
CPU_MV_MAX_ROWS = 1
# Dtypes for which torch.mv beats F.linear on this CPU at one row.
CPU_MV_DTYPES = (torch.bfloat16,)
# Rows of x up to which (from 2) bf16 linears use the native AMX kernel on CPU (see above): the
# amx tier's row of kernels/crossovers.py (the only tier with AMX tiles).
CPU_AMX_MAX_ROWS = crossovers.TABLE["amx"].amx_bf16_max_rows


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """Plain torch: exactly nn.Linear's forward."""
    return F.linear(x, weight, bias)


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether a Triton kernel must upcast tl.dot operands to fp32 (IEEE, not TF32).

    fp32 inputs: so the result matches torch's fp32 matmul to 1e-5 (TF32 keeps 10 bits).
    Under TRITON_INTERPRET=1: triton 3.9's interpreter returns garbage (~1e10) for bf16 tl.dot,
    so the interpreter computes every dot in fp32 (same math, the fp32 accumulator is kept).
    """
    return dtype == torch.float32 or _dispatch.triton_interpreting()


@functools.lru_cache(maxsize=1)
def _kernels():
    """Import Triton and define the kernels on first use (the module imports without Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _linear_gemv_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr, N, K,
        stride_xm, stride_wn, stride_wk, stride_ym,
        HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # One program: one row m of x, BLOCK_N outputs; streams a [BLOCK_N, K] weight slab.
        m = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + m * stride_xm + offs_k, mask=offs_k < K, other=0.0)
            w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
            w_mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
            acc += tl.sum(w.to(tl.float32) * xk.to(tl.float32)[None, :], axis=1)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        y = acc.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + m * stride_ym + offs_n, y, mask=offs_n < N)

    @triton.jit
    def _linear_gemm_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
        stride_xm, stride_wn, stride_wk, stride_ym,
        HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # One program: a [BLOCK_M, BLOCK_N] output tile, fp32 accumulator over K.
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x_mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
            xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask,
                         other=0.0)
            w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
            w_mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
            wt = tl.load(w_ptrs, mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N] = weight.T tile
            if DOT_FP32:
                acc += tl.dot(xt.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(xt, wt.to(xt.dtype))
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        y_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)

    return triton, _linear_gemv_kernel, _linear_gemm_kernel


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """GEMV kernel for M <= GEMV_MAX_ROWS rows, tiled GEMM otherwise; weight read by strides."""
    triton, gemv, gemm = _kernels()
    n, k = weight.shape
    x2 = x.reshape(-1, k).contiguous()  # [M, in]
    m = x2.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)  # [M, out]
    b = bias if bias is not None else y  # dummy pointer when HAS_BIAS is False
    strides = (x2.stride(0), weight.stride(0), weight.stride(1), y.stride(0))
    if m <= GEMV_MAX_ROWS:
        grid = (m, triton.cdiv(n, 64))
        gemv[grid](x2, weight, b, y, n, k, *strides, HAS_BIAS=bias is not None,
                   BLOCK_N=64, BLOCK_K=64)
    else:
        grid = (triton.cdiv(m, 32), triton.cdiv(n, 64))
        gemm[grid](x2, weight, b, y, m, n, k, *strides, HAS_BIAS=bias is not None,
                   DOT_FP32=dot_in_fp32(x.dtype), BLOCK_M=32, BLOCK_N=64, BLOCK_K=32)
    return y.reshape(*x.shape[:-1], n)


def _uses_cpu_mv(rows: int, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch.mv only where it was measured to beat F.linear: 1 row, bf16, row-major weight."""
    return rows <= CPU_MV_MAX_ROWS and x.dtype in CPU_MV_DTYPES and weight.stride(1) == 1


def _native_amx_lib(rows: int, x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None):
    """The native library when its AMX linear takes this call, else None: 2..CPU_AMX_MAX_ROWS
    bf16 rows, a contiguous bf16 weight with both sizes multiples of 32, a bf16 bias or none,
    nothing that needs autograd, not under torch.compile, and a CPU that grants AMX."""
    n, k = weight.shape
    # F.linear rounds twice (matmul, then add_) for a bias with a non-contiguous >2-D x
    twice = bias is not None and x.dim() > 2 and not x.is_contiguous()
    fits = (2 <= rows <= CPU_AMX_MAX_ROWS and x.dtype == weight.dtype == torch.bfloat16
            and not twice
            and n % 32 == 0 and k % 32 == 0 and weight.is_contiguous()
            and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad)))
            and not torch.compiler.is_compiling())
    return _native.lib() if fits and _native.amx_available() else None


def _native_bf16(lib, name: str, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """y = x @ weight.T + bias by the native bf16 kernel `name` (hfd_linear_bf16: AMX tiles,
    csrc/cpu_moe.c; hfd_gemv_bf16: csrc/cpu_experts.c; hfd_gemm_bf16: csrc/cpu_qgemm.c), which
    all take (x, w, bias, y, M, N, K, threads) and round once, as F.linear (their fp32 sums in
    another order, but for the AMX kernel's)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k).contiguous()
    y = torch.empty(x2.shape[0], n, dtype=x.dtype)
    code = getattr(lib, name)(x2.data_ptr(), weight.data_ptr(),
                              None if bias is None else bias.data_ptr(), y.data_ptr(),
                              x2.shape[0], n, k, torch.get_num_threads())
    if code:
        _native.check(code, name)
    return y.reshape(*x.shape[:-1], n)


def _native_linear(lib, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """y = x @ weight.T + bias by csrc/cpu_moe.c's hfd_linear_bf16 (AMX tiles)."""
    return _native_bf16(lib, "hfd_linear_bf16", x, weight, bias)


def _bf16_native_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """bf16 x and a contiguous bf16 weight, a contiguous bf16 bias or none, nothing that needs
    autograd, not under torch.compile: what the native bf16 GEMV and panel kernel take."""
    return (x.dtype == weight.dtype == torch.bfloat16 and weight.is_contiguous()
            and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad)))
            and not torch.compiler.is_compiling())


def _native_gemv_lib(rows: int, x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None):
    """The native library when its bf16 GEMV (csrc/cpu_experts.c) takes this call, else None:
    1..bf16_gemv_max_rows rows (the running tier's crossover; None: never) that
    _bf16_native_fits."""
    most = crossovers.rows().bf16_gemv_max_rows
    fits = most is not None and 1 <= rows <= most and _bf16_native_fits(x, weight, bias)
    return _native.lib("bf16_gemv") if fits else None


def _native_gemv(lib, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """y = x @ weight.T + bias by csrc/cpu_experts.c's hfd_gemv_bf16 (one rounding, as
    F.linear's; the fp32 sums in another order)."""
    return _native_bf16(lib, "hfd_gemv_bf16", x, weight, bias)


def _native_gemm_lib(rows: int, x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None):
    """The native library when its bf16 panel kernel (csrc/cpu_qgemm.c: hfd_gemm_bf16) takes
    this call, else None: bf16_gemv_max_rows + 1 .. bf16_gemm_max_rows rows (the running tier's
    crossovers; None: never), in features a multiple of 32, out features of 4, that
    _bf16_native_fits. The same dot products as the GEMV: its MIN_TIER ("bf16_gemv")."""
    bounds = crossovers.rows()
    n, k = weight.shape
    fits = (bounds.bf16_gemm_max_rows is not None
            and (bounds.bf16_gemv_max_rows or 0) < rows <= bounds.bf16_gemm_max_rows
            and k % 32 == 0 and n % 4 == 0 and _bf16_native_fits(x, weight, bias))
    return _native.lib("bf16_gemv") if fits else None


def _native_gemm(lib, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """y = x @ weight.T + bias by csrc/cpu_qgemm.c's hfd_gemm_bf16 (one rounding, as F.linear's;
    the fp32 sums in another order)."""
    return _native_bf16(lib, "hfd_gemm_bf16", x, weight, bias)


# Tiers whose CPUs have no bf16 dot products (no AVX512-BF16, no AMX): there oneDNN converts
# bf16 operands to fp32 inside its GEMM, and a bf16 F.linear of many rows is several times
# slower than the same product as fp32 GEMMs on converted chunks of the weight. On a Zen 4 with
# torch and oneDNN capped to each tier (2026-11-28, medians of 5, 2 threads; docs/performance.md),
# 2048 x 2048 and 5632 x 2048 weights, bf16 F.linear against the fp32 chunks: avx2 0.81-0.93x at 8
# rows, 1.30-1.46x at 16, 2.65x at 64, 3.35-3.40x at 512, 3.82-3.96x at 1024; avx512 (oneDNN
# capped to AVX512_CORE_VNNI) 0.84x at 8, 1.41x at 16, 1.98x at 64, 2.57x at 512. x86 only: no
# ARM CPU's bf16 GEMMs were measured (Arm's BF16 extension makes them native there).
FP32_GEMM_TIERS = ("generic", "avx2", "avx2_vnni", "avx512")
FP32_GEMM_MIN_ROWS = 16  # rows of x from which the fp32 GEMMs win there (see above)
FP32_CHUNK_ROWS = 512  # weight rows converted to fp32 at a time (512 x 8192: 16 MB)
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
# calls that ran the fp32 GEMMs (tests prove the path ran with it)
fp32_gemm_calls = 0


def fp32_gemm_tier() -> bool:
    """The running tier (the CPU's best, capped by settings isa) is one of FP32_GEMM_TIERS, on
    an x86 CPU."""
    return _X86 and _native.tier() in FP32_GEMM_TIERS


def bf16_gemm_in_fp32(x: torch.Tensor, rows: int) -> bool:
    """Whether a bf16 product of `rows` rows of x runs as fp32 GEMMs: on CPU, at a
    fp32_gemm_tier, from FP32_GEMM_MIN_ROWS rows, outside torch.compile (which compiles its
    own)."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and rows >= FP32_GEMM_MIN_ROWS
            and fp32_gemm_tier() and not torch.compiler.is_compiling())


def linear_fp32_chunks(x2: torch.Tensor, n: int, weight_rows, bias: torch.Tensor | None):
    """y [M, n] (bf16) = x2 [M, in] (bf16) times a weight of n rows, as fp32 GEMMs on
    FP32_CHUNK_ROWS rows of it at a time: weight_rows(start, stop) gives those rows [rows, in]
    in bf16 (a view, or rows dequantized in cache). bf16 -> fp32 is exact, the products
    accumulate in fp32 and the bias (fp32, exact) is added before the one rounding to bf16:
    bf16 F.linear's numerics (2-D x: addmm) up to the order of the fp32 sums."""
    global fp32_gemm_calls
    fp32_gemm_calls += 1
    xf = x2.float()
    y = torch.empty(x2.shape[0], n, dtype=x2.dtype, device=x2.device)
    for start in range(0, n, FP32_CHUNK_ROWS):
        stop = min(start + FP32_CHUNK_ROWS, n)
        b = None if bias is None else bias[start:stop].float()
        y[:, start:stop] = F.linear(xf, weight_rows(start, stop).float(), b)
    return y


def _linear_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """F.linear(x, weight, bias) for bf16 x, weight and bias by linear_fp32_chunks."""
    n, k = weight.shape
    y = linear_fp32_chunks(x.reshape(-1, k), n, lambda start, stop: weight[start:stop], bias)
    return y.reshape(*x.shape[:-1], n)


def native_bf16_takes(x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> bool:
    """linear_cpu would run this call on the tier's native bf16 GEMV or panel kernel."""
    k = weight.shape[1]
    rows = x.numel() // k if k else 0
    return (x.device.type == "cpu" and rows >= 1
            and (_native_gemv_lib(rows, x, weight, bias) is not None
                 or _native_gemm_lib(rows, x, weight, bias) is not None))


def linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """The native bf16 GEMV for up to bf16_gemv_max_rows bf16 rows where the tier's crossover
    has one, then its panel kernel up to bf16_gemm_max_rows; else torch.mv for a single bf16
    row on a row-major weight; the native AMX kernel for 2 to CPU_AMX_MAX_ROWS bf16 rows; fp32
    GEMMs for more bf16 rows on a CPU without bf16 dot products (bf16_gemm_in_fp32); F.linear
    (addmm / oneDNN) else."""
    k = weight.shape[1]
    rows = x.numel() // k if k else 0
    if x.device.type == "cpu" and rows >= 1:
        lib = _native_gemv_lib(rows, x, weight, bias)
        if lib is not None:
            return _native_gemv(lib, x, weight, bias)
        lib = _native_gemm_lib(rows, x, weight, bias)
        if lib is not None:
            return _native_gemm(lib, x, weight, bias)
    if x.device.type == "cpu" and rows >= 2:
        lib = _native_amx_lib(rows, x, weight, bias)
        if lib is not None:
            return _native_linear(lib, x, weight, bias)
    if (bf16_gemm_in_fp32(x, rows) and weight.dtype == torch.bfloat16
            and (bias is None or (bias.dtype == torch.bfloat16 and x.is_contiguous()))):
        return _linear_fp32(x, weight, bias)
    if not _uses_cpu_mv(rows, x, weight) or rows == 0:
        return F.linear(x, weight, bias)
    vec = x.reshape(k)  # [in]
    y = torch.mv(weight, vec) if bias is None else torch.addmv(bias, weight, vec)  # [out]
    return y.reshape(*x.shape[:-1], weight.shape[0])


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """y = x @ weight.T + bias with the kernel chosen by device, dtype and number of rows.

    On CUDA only an explicit "triton" (argument or setting) runs the Triton kernels; "auto"
    runs cuBLAS (F.linear), which on an H200 took 0.026 ms where the Triton GEMV took 0.062
    (1 x 2048 @ 2048 x 2048, bf16) and 0.024 where the Triton GEMM took 0.050 (64 rows):
    docs/gpu.md."""
    fn = _dispatch.pick(backend, x.device, ref=linear_ref, cpu_fn=linear_cpu,
                        triton_fn=linear_triton if _dispatch.triton_named(backend) else None)
    return fn(x, weight, bias)
