"""Residual add fused with LayerNorm / RMSNorm.

A decoder block computes `h = residual + (x + x_bias)` (the attention or MLP output, its
optional un-fused bias, and the residual stream) and immediately normalizes `h` for the next
sub-layer. Doing both in one pass reads `x` and `residual` once and writes `h` (the new residual
stream) and `norm(h)` together.

Shapes: x, residual [..., hidden] (any number of leading dims); x_bias, weight, bias [hidden].
Both ops return `(norm(h), h)`; when there is nothing to add, `h` is `x` itself.

Numerics (the Hugging Face eager ones):
    h           additions in the input dtype, in HF's order `residual + (x + x_bias)`, so `h`
                is bit-identical to HF's residual stream.
    layer_norm  torch.nn.LayerNorm: mean and variance (biased) in fp32, `(h - mean) * rstd * w
                + b`, output in x's dtype.
    layer_norm_fp32  Cohere's LayerNorm (no bias), HF's six eager ops: `hf = h.float()`, the
                mean, then the variance of `hf - mean` (two passes), `(hf - mean) *
                rsqrt(var + eps)`, times `weight.float()`, rounded once to h's dtype. The weight
                may be [heads, head_dim] over [..., heads, head_dim] (Cohere's q / k norms).
    layer_norm_plain  OLMo's LayerNorm (no weight, no bias): `F.layer_norm(h.float())`, rounded
                once to h's dtype.
    rms_norm    LlamaRMSNorm: `hf = h.float(); hf * rsqrt(mean(hf**2) + eps)`, rounded back to
                h's dtype *before* the weight multiply, then `weight * that` (so the output dtype
                is the promotion of weight's and h's dtypes, as in HF).
    rms_norm styles (the weight multiply, which is where families' RMSNorms differ):
                "llama"  as above;
                "fp32"   OLMo 2: `(weight * hf_normalized).to(h.dtype)`, the multiply in fp32;
                "gemma"  Gemma 2/3: `(hf_normalized * (1 + weight.float())).to(h.dtype)`.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F

from hf_dsinfer.kernels import _dispatch, _native


def _residual_sum(x: torch.Tensor, residual: torch.Tensor | None,
                  x_bias: torch.Tensor | None) -> torch.Tensor:
    """h = residual + (x + x_bias), skipping the absent terms, in HF's addition order."""
    h = x if x_bias is None else x + x_bias
    return h if residual is None else residual + h


def layer_norm_ref(x, weight, bias, eps, residual=None, x_bias=None):
    """Reference: the residual sum, then torch's LayerNorm (exactly what nn.LayerNorm runs)."""
    h = _residual_sum(x, residual, x_bias)
    return F.layer_norm(h, (h.shape[-1],), weight, bias, eps), h


RMS_STYLES = ("llama", "fp32", "gemma")


def _fp32_weight(weight: torch.Tensor, style: str) -> torch.Tensor:
    """The weight factor of the fp32-multiply styles: w (OLMo 2) or 1 + w (Gemma), in fp32."""
    return weight.float() + 1.0 if style == "gemma" else weight.float()


def _check_style(style: str) -> str:
    if style not in RMS_STYLES:
        raise ValueError(f"rms_norm style: expected one of {RMS_STYLES}, got {style!r}")
    return style


def rms_norm_ref(x, weight, eps, residual=None, x_bias=None, style="llama"):
    """Reference: the residual sum, then LlamaRMSNorm's forward line for line (Olmo2RMSNorm's
    or Gemma2RMSNorm's for the other styles)."""
    h = _residual_sum(x, residual, x_bias)
    hf = h.to(torch.float32)
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return rms_weight(hf, weight, h.dtype, style), h


def rms_weight(normed: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype,
               style: str = "llama") -> torch.Tensor:
    """The weight multiply of an RMSNorm, in the numerics of `style`: `normed` is the fp32
    normalized value, `dtype` the input's (also used by tensor parallelism's sharded q/k norm)."""
    if _check_style(style) != "llama":
        return (normed * _fp32_weight(weight, style)).to(dtype)
    return weight * normed.to(dtype)


# ----------------------------------------------------------------------------- Triton kernels
# One program normalizes one row of `hidden` elements held entirely in registers
# (BLOCK = next power of two >= hidden). Each addition is rounded to h's dtype, as torch does
# for an eager `a + b`, so the stored h matches HF's residual stream bit for bit.


@functools.cache
def _kernels() -> types.SimpleNamespace:
    """Import Triton and define its kernels (once per process)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _norm_kernel(X, RES, XB, W, B, OUT, H, hidden, eps,
                     HAS_RES: tl.constexpr, HAS_XBIAS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     STORE_H: tl.constexpr, BLOCK: tl.constexpr, LAYER: tl.constexpr,
                     FP32_WEIGHT: tl.constexpr, UNIT_OFFSET: tl.constexpr):
        # One row: h = residual + (x + x_bias) (each add rounded to H's dtype, as eager's),
        # stored when asked, then LayerNorm (LAYER) or RMSNorm of h. One kernel for both, so
        # the residual prologue is written once.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < hidden
        h = tl.load(X + row * hidden + cols, mask=m, other=0.0)
        if HAS_XBIAS:
            xb = tl.load(XB + cols, mask=m, other=0.0)
            h = (h.to(tl.float32) + xb.to(tl.float32)).to(H.dtype.element_ty)
        if HAS_RES:
            r = tl.load(RES + row * hidden + cols, mask=m, other=0.0)
            h = (r.to(tl.float32) + h.to(tl.float32)).to(H.dtype.element_ty)
        if STORE_H:
            tl.store(H + row * hidden + cols, h, mask=m)
        # Statistics in fp32: a bf16 sum over thousands of elements would lose the mean.
        hf = h.to(tl.float32)
        if LAYER:
            mean = tl.sum(hf, axis=0) / hidden
            d = tl.where(m, hf - mean, 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / hidden + eps)  # biased, as torch
            y = d * rstd * tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
            if HAS_BIAS:
                y = y + tl.load(B + cols, mask=m, other=0.0).to(tl.float32)
        else:
            rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / hidden + eps)
            w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
            if FP32_WEIGHT:  # OLMo 2 / Gemma: multiply in fp32 (by 1 + w for Gemma), round once
                if UNIT_OFFSET:
                    w = w + 1.0
                y = hf * rstd * w
            else:  # Llama: HF rounds the normalized value to h's dtype before the weight
                y = (hf * rstd).to(H.dtype.element_ty).to(tl.float32)
                y = y * w
        tl.store(OUT + row * hidden + cols, y.to(OUT.dtype.element_ty), mask=m)

    return types.SimpleNamespace(
        next_power_of_2=triton.next_power_of_2,
        norm=_norm_kernel,
    )


def _rows(t: torch.Tensor | None, hidden: int) -> torch.Tensor | None:
    """[..., hidden] -> contiguous [N, hidden] (None stays None)."""
    return None if t is None else t.reshape(-1, hidden).contiguous()


def _launch_args(x, residual, x_bias):
    """Flattened inputs and the h buffer shared by both launchers."""
    hidden = x.shape[-1]
    x2, res2, xb = _rows(x, hidden), _rows(residual, hidden), _rows(x_bias, hidden)
    h_dtype = x.dtype
    for t in (x_bias, residual):
        h_dtype = h_dtype if t is None else torch.promote_types(h_dtype, t.dtype)
    store_h = residual is not None or x_bias is not None
    h2 = torch.empty(x2.shape, dtype=h_dtype, device=x.device) if store_h else x2
    return x2, res2, xb, h2, store_h


def layer_norm_triton(x, weight, bias, eps, residual=None, x_bias=None):
    k = _kernels()
    hidden = x.shape[-1]
    x2, res2, xb, h2, store_h = _launch_args(x, residual, x_bias)
    out = torch.empty(x2.shape, dtype=h2.dtype, device=x.device)  # [N, hidden]
    bias_arg = bias.contiguous() if bias is not None else weight
    k.norm[(x2.shape[0],)](
        x2, res2 if res2 is not None else x2, xb if xb is not None else x2,
        weight.contiguous(), bias_arg, out, h2, hidden, eps,
        HAS_RES=res2 is not None, HAS_XBIAS=xb is not None, HAS_BIAS=bias is not None,
        STORE_H=store_h, BLOCK=k.next_power_of_2(hidden), LAYER=True, FP32_WEIGHT=False,
        UNIT_OFFSET=False,
    )
    shape = (*x.shape[:-1], hidden)
    return out.view(shape), (h2.view(shape) if store_h else x)


def rms_norm_triton(x, weight, eps, residual=None, x_bias=None, style="llama"):
    k = _kernels()
    hidden = x.shape[-1]
    x2, res2, xb, h2, store_h = _launch_args(x, residual, x_bias)
    llama = _check_style(style) == "llama"
    out_dtype = torch.promote_types(weight.dtype, h2.dtype) if llama else h2.dtype
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)  # [N, hidden]
    w = weight.contiguous()
    k.norm[(x2.shape[0],)](
        x2, res2 if res2 is not None else x2, xb if xb is not None else x2, w, w, out, h2,
        hidden, eps, HAS_RES=res2 is not None, HAS_XBIAS=xb is not None, HAS_BIAS=False,
        STORE_H=store_h, BLOCK=k.next_power_of_2(hidden), LAYER=False,
        FP32_WEIGHT=not llama, UNIT_OFFSET=style == "gemma",
    )
    shape = (*x.shape[:-1], hidden)
    return out.view(shape), (h2.view(shape) if store_h else x)


# LayerNorm: the reference already is torch's fused CPU kernel (F.layer_norm), so no cpu variant.


def rms_norm_cpu(x, weight, eps, residual=None, x_bias=None, style="llama"):
    """RMSNorm through torch's fused F.rms_norm instead of the reference's six eager ops; bf16
    rows of the "llama" style by the native kernel (_rms_native)."""
    if torch.compiler.is_compiling():
        # Traced, the reference's ops fuse in inductor anyway. F.rms_norm traced next to the
        # attention's sdpa gave NaN logits with inductor's AVX2 code (torch 2.13,
        # ATEN_CPU_CAPABILITY=avx2 on a Zen 5; either op alone on the reference was fine).
        return rms_norm_ref(x, weight, eps, residual, x_bias, style)
    h = _residual_sum(x, residual, x_bias)
    hidden = (h.shape[-1],)
    if _check_style(style) != "llama":
        return rms_weight(F.rms_norm(h.float(), hidden, None, eps), weight, h.dtype, style), h
    if h.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(h, hidden, weight, eps), h
    lib = _native.lib("rows")
    if (lib is not None and h.dtype == weight.dtype == torch.bfloat16 and h.is_contiguous()
            and weight.is_contiguous() and h.numel()
            and not (torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad))):
        return _rms_native(lib, h, weight, eps), h
    # Low precision: normalize in fp32 and round to h's dtype before the weight multiply, as HF
    # does (F.rms_norm on bf16 input would skip that rounding and differ by one ulp).
    return weight * F.rms_norm(h.float(), hidden, None, eps).to(h.dtype), h


def _rms_native(lib, h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The "llama" style of bf16 rows by the decode layer's RMSNorm (csrc/cpu_decode.c:
    hfd_rms_rows_bf16: the sum of squares in 16 fp32 lanes, then HF's roundings); it gave
    F.rms_norm's bits on every row tried (the fp32-multiply styles did not, by an ulp here and
    there, so they keep torch's ops)."""
    n = h.shape[-1]
    out = torch.empty_like(h)
    code = lib.hfd_rms_rows_bf16(h.data_ptr(), h.numel() // n, n, weight.data_ptr(), float(eps),
                                 0, out.data_ptr(), torch.get_num_threads())  # NORM_RMS
    _native.check(code, "hfd_rms_rows_bf16")
    return out


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               residual: torch.Tensor | None = None, x_bias: torch.Tensor | None = None, *,
               backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(LayerNorm(h), h) with h = residual + (x + x_bias); x is [..., hidden]."""
    fn = _dispatch.pick(backend, x.device, ref=layer_norm_ref, triton_fn=layer_norm_triton)
    return fn(x, weight, bias, eps, residual, x_bias)


def layer_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None, x_bias: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(Cohere's LayerNorm(h), h) with h = residual + (x + x_bias): CohereLayerNorm's forward
    line for line (the module doc above), on every backend."""
    h = _residual_sum(x, residual, x_bias)
    hf = h.to(torch.float32)
    centered = hf - hf.mean(-1, keepdim=True)
    variance = centered.pow(2).mean(-1, keepdim=True)
    return (weight.to(torch.float32) * (centered * torch.rsqrt(variance + eps))).to(h.dtype), h


def layer_norm_plain(x: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                     x_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(OLMo's LayerNorm(h), h) with h = residual + (x + x_bias): OlmoLayerNorm's forward (no
    affine parameters, statistics and normalization in fp32, one rounding), on every backend."""
    h = _residual_sum(x, residual, x_bias)
    return F.layer_norm(h.to(torch.float32), (h.shape[-1],), None, None, eps).to(h.dtype), h


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, x_bias: torch.Tensor | None = None, *,
             backend: str | None = None, style: str = "llama") -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(h), h) with h = residual + (x + x_bias), HF numerics of `style` (RMS_STYLES);
    x is [..., hidden]."""
    fn = _dispatch.pick(backend, x.device, ref=rms_norm_ref, triton_fn=rms_norm_triton,
                        cpu_fn=rms_norm_cpu)
    return fn(x, weight, eps, residual, x_bias, style)
