"""Every Triton kernel of the package and the launches its launcher makes, for ahead-of-time
compiles (tests/kernels/test_triton_aot.py): no GPU, no CUDA driver, only Triton's compiler and
the ptxas it ships.

`load_kernels()` finds the kernels: each module of hf_dsinfer that jits one is loaded afresh as
a private copy with TRITON_INTERPRET=0 and its `_kernels()` factory called, so the kernels are
real JITFunctions, exactly as a GPU machine builds them, while the package's own (interpreted)
kernels that the other tests run stay untouched. `compile_case` runs only in a process that
imported Triton with the interpreter off (`compiler_process_init`): Triton jits its own
standard library (tl.sum, tl.sigmoid, tl.cumsum...) when first imported, and under
TRITON_INTERPRET=1 those become interpreter functions that the compiler cannot inline. So this
module imports neither Triton nor hf_dsinfer (whose import pulls in torch._inductor, and Triton
with it) when it is imported: a compile worker imports it first.

Each `AotCase` is one specialization a launcher (`<op>_triton` in hf_dsinfer/kernels) really
asks Triton for: the Triton type of every runtime argument and the value of every constexpr,
read off the launcher. Triton's launcher specializes like this (triton 3.9 `specialize_impl`):
a tensor becomes `*<dtype>` with 16-byte alignment (torch's allocations; so every case marks
its pointers aligned), a Python int `i32` (`i64` from 2**31 on, which no case here reaches;
no divisibility hint on ints: the code any shape gets), a Python float `fp32`, a bool or None
passed to a constexpr parameter its value, and an int argument equal to 1 becomes the constexpr
1: so a decode step's `sq == 1` or a contiguous last-dim stride is listed among the constexprs,
as a GPU would compile it. Launchers leave num_warps and num_stages at Triton's defaults (4, 3),
except where a case's `options` says otherwise.

Where a launcher picks block sizes from shapes (next power of two of hidden / head_dim, ...)
the cases cover the values real models give (named in each label); kernels with a fixed block
size are covered at it. Every kernel is covered in fp32, bf16 and fp16 activations.

Signatures are written as compact specs, "X:*T RES:*T hidden eps:fp32": a bare name is `i32`,
`T` stands for the case's activation dtype.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

DTYPES = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class AotCase:
    kernel: str  # "<module>.<kernel function>", e.g. "norms._norm_kernel"
    label: str  # the launch it stands for, e.g. "res-B4096" (hidden 4096, Llama-7B)
    dtype: str  # activations' dtype, Triton's name: "fp32", "bf16" or "fp16"
    args: dict[str, str] = field(hash=False)  # runtime argument -> Triton type
    constexprs: dict[str, object] = field(hash=False)  # constexpr argument -> value
    options: dict[str, int] = field(default_factory=dict, hash=False)  # e.g. num_stages

    @property
    def id(self) -> str:
        return f"{self.kernel}-{self.label}-{self.dtype}"


def sig(spec: str, dtype: str) -> dict[str, str]:
    """'X:*T OUT:*T numel eps:fp32' -> {'X': '*bf16', 'OUT': '*bf16', 'numel': 'i32', ...}."""
    out = {}
    for item in spec.split():
        name, _, ty = item.partition(":")
        out[name] = ty.replace("T", dtype) if ty else "i32"
    return out


def act_codes() -> dict[str, int]:
    """Activation name -> the kernels' ACT constexpr (activations._ACT_CODE)."""
    from hf_dsinfer.kernels.activations import _ACT_CODE

    return _ACT_CODE


def case(kernel: str, label: str, dtype: str, spec: str, options: dict | None = None,
         **constexprs) -> AotCase:
    """One launch; a constexpr named like a runtime argument replaces it (an int equal to 1);
    `options`: compile options the launcher sets (num_stages)."""
    args = {k: v for k, v in sig(spec, dtype).items() if k not in constexprs}
    return AotCase(kernel, label, dtype, args, constexprs, options or {})


# ----------------------------------------------------------------------------- activations
# One kernel for both ops. BLOCK = min(1024, max(16, next_pow2(columns))): every real hidden or
# intermediate size (>= 768) gives 1024; 16 is the floor (tiny test models). bias_act: out
# dtype = x's (same-dtype bias), U unused (x again), stride_u 0; gated_act: BIAS unused.

_ACT = "X:*T BIAS:*T U:*T OUT:*T cols stride_x stride_u"


def _activation_cases() -> list[AotCase]:
    cases, codes = [], act_codes()
    for dt in DTYPES:
        for act, code in codes.items():
            cases.append(case("activations._act_kernel", f"{act}-bias", dt, _ACT,
                              HAS_BIAS=True, GATED=False, ACT=code, BLOCK=1024))
            cases.append(case("activations._act_kernel", f"{act}-gated-B1024", dt, _ACT,
                              HAS_BIAS=False, GATED=True, ACT=code, BLOCK=1024))
        cases.append(case("activations._act_kernel", "silu-nobias", dt, _ACT,
                          HAS_BIAS=False, GATED=False, ACT=codes["silu"], BLOCK=1024))
        cases.append(case("activations._act_kernel", "silu-gated-B16", dt, _ACT,
                          HAS_BIAS=False, GATED=True, ACT=codes["silu"], BLOCK=16))
    return cases


# ----------------------------------------------------------------------------- alibi
# alibi_bias_triton: the mask is converted to int32, slopes are fp32, BLOCK 256.


def _alibi_cases() -> list[AotCase]:
    return [case("alibi._alibi_bias_kernel", "B256", dt,
                 "MASK:*i32 SLOPES:*fp32 OUT:*T heads seq", BLOCK=256) for dt in DTYPES]


# ----------------------------------------------------------------------------- attention
# _launch: BLOCK_D = max(16, next_pow2(head_dim)), BLOCK_DV the same of the values' head dim;
# prefill BLOCK_Q = max(1, 64 // p), BLOCK_N 32, decode (Sq == 1) BLOCK_Q 1, BLOCK_N 64;
# BLOCK_G = max(min(p, 64 // BLOCK_Q), 16 // BLOCK_Q), with p = next_pow2(Hq // Hkv). Wide
# heads (BLOCK_D > 256: MLA's absorbed decode) take BLOCK_N 16 and at most 16 rows, and in
# fp32 num_stages 1. A bool mask is passed as uint8, a float mask / ALiBi bias in the
# activations' dtype (HF builds them so); their last-dim stride is 1 (so a constexpr), and
# absent ones pass q and zero strides. DOT_PRECISION "ieee" for fp32, else None (tensor
# cores); DOT_FP32 is False off the interpreter. The fused layers pass causal only for a
# maskless prefill (injection/fused.py: causal=mask is None and s > 1) and never a window; the
# window case covers the public API (Mistral-style sliding window).

_ATTENTION = ("Q:*T K:*T V:*T O:*T MASK:*M BIAS:*B sqb sqh sqs skb skh sks svb svh svs sob soh "
              "sos smb smh smq smk sbb sbh sbq sbk hkv rep sq sk dim dim_v scale:fp32 mask_min:fp32 "
              "window")


class _Attn(NamedTuple):
    rep: int  # query heads per kv head
    head_dim: int  # of queries and keys
    decode: bool  # one query per sequence (Sq == 1)
    mask_kind: int  # MASK_KIND: 0 none, 1 bool, 2 additive float
    alibi: bool  # an ALiBi bias
    causal: bool
    window: bool
    dtypes: tuple[str, ...] = ("bf16",)
    v_dim: int | None = None  # of values, when not head_dim (MLA's absorbed decode)


_ATTENTION_LAUNCHES = {
    # Llama-3-8B / Mistral-7B (GQA 4), maskless prefill: causal
    "prefill-gqa4-d128-causal": _Attn(4, 128, False, 0, False, True, False, DTYPES),
    # Llama-2-7B with left padding (sdpa's bool mask)
    "prefill-mha-d128-boolmask": _Attn(1, 128, False, 1, False, False, False, DTYPES),
    # BLOOM: eager's additive float mask plus ALiBi bias
    "prefill-mha-d64-floatmask-alibi": _Attn(1, 64, False, 2, True, False, False,
                                             ("bf16", "fp16")),
    # Mistral-7B v0.1, sliding window
    "prefill-gqa4-d128-causal-window": _Attn(4, 128, False, 0, False, True, True),
    # Llama-2-70B / Llama-3-70B (GQA 8)
    "prefill-gqa8-d128-boolmask": _Attn(8, 128, False, 1, False, False, False),
    # Gemma-7B: head_dim 256
    "prefill-mha-d256-causal": _Attn(1, 256, False, 0, False, True, False),
    # decode steps: one query per sequence, the whole cache in 64-key tiles
    "decode-gqa4-d128": _Attn(4, 128, True, 0, False, False, False, DTYPES),
    "decode-mha-d64-boolmask": _Attn(1, 64, True, 1, False, False, False),
    "decode-mha-d128-floatmask-alibi": _Attn(1, 128, True, 2, True, False, False),
    "decode-mha-d256": _Attn(1, 256, True, 0, False, False, False),
    # DeepSeek-V3's absorbed MLA decode: 128 heads over one latent KV head, keys latent 512 +
    # rope 64, values the latent itself; left padding's bool mask
    "decode-mla-d576-v512-boolmask": _Attn(128, 576, True, 1, False, False, False, DTYPES, 512),
}


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _attention_case(label: str, dt: str, a: _Attn) -> AotCase:
    p = _next_pow2(a.rep)
    block_q = 1 if a.decode else max(1, 64 // p)
    block_d = max(16, _next_pow2(a.head_dim))
    wide = block_d > 256  # _launch: 16-key tiles, at most 16 rows per program
    spec = _ATTENTION.replace("*M", "*u8" if a.mask_kind == 1 else "*T").replace("*B", "*T")
    ones = {"rep": 1} if a.rep == 1 else {}  # ints equal to 1 specialize (see the top)
    ones |= {"sq": 1} if a.decode else {}
    ones |= {"smk": 1} if a.mask_kind else {}
    ones |= {"sbk": 1} if a.alibi else {}
    options = {"num_stages": 1} if wide and dt == "fp32" else None
    return case("attention._attention_kernel", label, dt, spec, options, **ones,
                MASK_KIND=a.mask_kind, HAS_BIAS=a.alibi, CAUSAL=a.causal, HAS_WINDOW=a.window,
                DOT_PRECISION="ieee" if dt == "fp32" else None, DOT_FP32=False,
                BLOCK_G=max(min(p, max(1, (16 if wide else 64) // block_q)), 16 // block_q),
                BLOCK_Q=block_q, BLOCK_N=16 if wide else (64 if a.decode else 32),
                BLOCK_D=block_d,
                BLOCK_DV=max(16, _next_pow2(a.v_dim or a.head_dim)))


def _attention_cases() -> list[AotCase]:
    return [_attention_case(label, dt, launch)
            for label, launch in _ATTENTION_LAUNCHES.items() for dt in launch.dtypes]


# ----------------------------------------------------------------------------- norms
# layer_norm_triton / rms_norm_triton: BLOCK = next_pow2(hidden), one row per program in
# registers; STORE_H when a residual or x bias is added; pointers not passed get x (all in the
# activations' dtype). Hidden sizes: GPT-2 768 -> 1024, Llama-7B 4096, Llama-65B 8192,
# BLOOM-176B 14336 / GPT-3 12288 -> 16384; rms_norm also runs per head (Qwen3 q/k norm, 128).

_NORM = "X:*T RES:*T XB:*T W:*T B:*T OUT:*T H:*T hidden eps:fp32"  # rms: B gets W
_LAYER = {"LAYER": True, "FP32_WEIGHT": False, "UNIT_OFFSET": False}
_RMS = {"LAYER": False, "HAS_BIAS": False, "FP32_WEIGHT": False, "UNIT_OFFSET": False}


def _norm_cases() -> list[AotCase]:
    cases = []
    for dt in DTYPES:
        for block in (1024, 4096, 8192, 16384):
            cases.append(case("norms._norm_kernel", f"layer-res-xbias-bias-B{block}", dt, _NORM,
                              HAS_RES=True, HAS_XBIAS=True, HAS_BIAS=True, STORE_H=True,
                              BLOCK=block, **_LAYER))
            cases.append(case("norms._norm_kernel", f"rms-res-B{block}", dt, _NORM,
                              HAS_RES=True, HAS_XBIAS=False, STORE_H=True, BLOCK=block, **_RMS))
        cases.append(case("norms._norm_kernel", "layer-plain-B1024", dt, _NORM, HAS_RES=False,
                          HAS_XBIAS=False, HAS_BIAS=True, STORE_H=False, BLOCK=1024, **_LAYER))
        cases.append(case("norms._norm_kernel", "rms-qk-norm-B128", dt, _NORM, HAS_RES=False,
                          HAS_XBIAS=False, STORE_H=False, BLOCK=128, **_RMS))
        # Gemma's (1 + w) in fp32 (OLMo 2's fp32 multiply is the same code without the offset)
        cases.append(case("norms._norm_kernel", "rms-gemma-res-B4096", dt, _NORM,
                          HAS_RES=True, HAS_XBIAS=False, STORE_H=True, BLOCK=4096,
                          **{**_RMS, "FP32_WEIGHT": True, "UNIT_OFFSET": True}))
    return cases


# ----------------------------------------------------------------------------- rotary
# _rotate_triton: BLOCK_S 16, BLOCK_HALF = next_pow2(rot // 2), BLOCK_PASS = next_pow2(dim -
# rot) or 0 (full rotary); cos / sin in q's dtype (HF's position_embeddings).

_ROTARY = "X:*T COS:*T SIN:*T OUT:*T heads seq rot dim sxb sxh sxs scb scs"

# label: (interleaved, rot, dim, decode)
_ROTARY_LAUNCHES = {
    "llama-d128": (False, 128, 128, False),
    "llama-d128-decode": (False, 128, 128, True),
    "gptj-interleaved-r64-d256": (True, 64, 256, False),
    "neox-partial-r32-d128": (False, 32, 128, False),
    "phi-partial-r32-d80": (False, 32, 80, False),
}


def _rotary_cases() -> list[AotCase]:
    cases = []
    for label, (interleaved, rot, dim, decode) in _ROTARY_LAUNCHES.items():
        ones = {"seq": 1} if decode else {}
        for dt in DTYPES:
            cases.append(case("rotary._apply_rotary_kernel", label, dt, _ROTARY, **ones,
                              INTERLEAVED=interleaved, BLOCK_S=16,
                              BLOCK_HALF=_next_pow2(rot // 2),
                              BLOCK_PASS=_next_pow2(dim - rot) if dim > rot else 0))
    return cases


# ----------------------------------------------------------------------------- linear
# linear_triton: GEMV (<= 4 rows) BLOCK_N 64, BLOCK_K 64; GEMM BLOCK 32 x 64 x 32,
# DOT_FP32 for fp32. nn.Linear weights are [out, in] row-major (stride_wk == 1, a constexpr);
# GPT-2's Conv1D passes weight.t() (stride_wn == 1).

_GEMV = "x_ptr:*T w_ptr:*T b_ptr:*T y_ptr:*T N K stride_xm stride_wn stride_wk stride_ym"
_GEMM = "x_ptr:*T w_ptr:*T b_ptr:*T y_ptr:*T M N K stride_xm stride_wn stride_wk stride_ym"


def _linear_cases() -> list[AotCase]:
    cases = []
    for dt in DTYPES:
        for label, ones, bias in (("rowmajor-bias", {"stride_wk": 1}, True),
                                  ("rowmajor", {"stride_wk": 1}, False),
                                  ("conv1d-bias", {"stride_wn": 1}, True)):
            cases.append(case("linear._linear_gemv_kernel", label, dt, _GEMV, **ones,
                              HAS_BIAS=bias, BLOCK_N=64, BLOCK_K=64))
            cases.append(case("linear._linear_gemm_kernel", label, dt, _GEMM, **ones,
                              HAS_BIAS=bias, DOT_FP32=dt == "fp32",
                              BLOCK_M=32, BLOCK_N=64, BLOCK_K=32))
    return cases


# ----------------------------------------------------------------------------- quant
# linear_int8_triton / linear_int4_triton: BLOCK 16 x 64 x 32, DOT_FP32 for fp32; scales and
# mins in the weight's (= activations') dtype; a decode step has M == 1 (a constexpr).
# int4 GROUP is the group size, one of quant.INT4_GROUP_SIZES.

_INT8 = ("x_ptr:*T q_ptr:*i8 s_ptr:*T b_ptr:*T y_ptr:*T M N K stride_xm stride_qn "
         "stride_ym")
_INT4 = ("x_ptr:*T p_ptr:*u8 s_ptr:*T z_ptr:*T b_ptr:*T y_ptr:*T M N K stride_xm stride_pn "
         "stride_sn stride_ym")


def _quant_cases() -> list[AotCase]:
    cases = []
    blocks = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32}
    for dt in DTYPES:
        fp32 = dt == "fp32"
        cases.append(case("quant._linear_int8_kernel", "decode", dt, _INT8, M=1,
                          HAS_BIAS=False, DOT_FP32=fp32, **blocks))
        cases.append(case("quant._linear_int8_kernel", "prefill-bias", dt, _INT8,
                          HAS_BIAS=True, DOT_FP32=fp32, **blocks))
        for group in (32, 64, 128, 256):
            cases.append(case("quant._linear_int4_kernel", f"g{group}", dt, _INT4,
                              GROUP=group, HAS_BIAS=False, DOT_FP32=fp32, **blocks))
        cases.append(case("quant._linear_int4_kernel", "g128-decode-bias", dt, _INT4, M=1,
                          GROUP=128, HAS_BIAS=True, DOT_FP32=fp32, **blocks))
    return cases


# ----------------------------------------------------------------------------- kv_quant
# int8: BLOCK_D = next_pow2(head_dim) (64; 80 / 96 / 128 -> 128; 256), scales in x's dtype,
# dequantized to the scales' dtype. int4: HALF = group_size // 2 (32 / 64 default / 128 =
# head_dim), scales and mins fp16, dequantized to the cache's dtype.


def _kv_quant_cases() -> list[AotCase]:
    cases = []
    for dt in DTYPES:
        for block in (64, 128, 256):
            cases.append(case("kv_quant._quantize_kv_int8_kernel", f"B{block}", dt,
                              "x_ptr:*T q_ptr:*i8 s_ptr:*T D", BLOCK_D=block))
            cases.append(case("kv_quant._dequantize_kv_int8_kernel", f"B{block}", dt,
                              "q_ptr:*i8 s_ptr:*T y_ptr:*T D", BLOCK_D=block))
        for group in (32, 64, 128):
            cases.append(case("kv_quant._quantize_kv_int4_kernel", f"g{group}", dt,
                              "x_ptr:*T p_ptr:*u8 s_ptr:*fp16 m_ptr:*fp16", HALF=group // 2))
            cases.append(case("kv_quant._dequantize_kv_int4_kernel", f"g{group}", dt,
                              "p_ptr:*u8 s_ptr:*fp16 m_ptr:*fp16 y_ptr:*T", HALF=group // 2))
    return cases


# ----------------------------------------------------------------------------- moe
# topk_gating_triton: BLOCK_E = next_pow2(E), BLOCK_K = next_pow2(top_k); weights fp32, ids
# int64. Expert kernels: BLOCK 16 x 32 x 32, DOT_FP32 for fp32; token / tile tables are int64
# (argsort, repeat_interleave); routing weights fp32 (Mixtral, grouped_expert_rows) or cast to
# the activations' dtype (Qwen2/3-MoE, OLMoE).

_TOPK = "logits_ptr:*T w_ptr:*fp32 ids_ptr:*i64 E stride_t"
# label: (experts, top_k, softmax_first, renormalize)
_TOPK_LAUNCHES = {
    "mixtral-e8-k2": (8, 2, True, True),
    "qwen2moe-e60-k4": (60, 4, True, False),
    "olmoe-e64-k8": (64, 8, True, False),
    "qwen3moe-e128-k8": (128, 8, True, True),
    "logits-first-e8-k2": (8, 2, False, False),
}
_GATE_UP = ("x_ptr:*T tok_ptr:*i64 w_ptr:*T out_ptr:*T tile_e_ptr:*i64 tile_r0_ptr:*i64 "
            "tile_r1_ptr:*i64 H I stride_xt stride_we stride_wn stride_om")
_DOWN = ("a_ptr:*T w_ptr:*T rw_ptr:*R flat_ptr:*i64 out_ptr:*T tile_e_ptr:*i64 "
         "tile_r0_ptr:*i64 tile_r1_ptr:*i64 H I stride_am stride_we stride_wn stride_om")


def _moe_cases() -> list[AotCase]:
    cases, codes = [], act_codes()
    blocks = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}
    for dt in DTYPES:
        fp32 = dt == "fp32"
        for label, (experts, k, first, renorm) in _TOPK_LAUNCHES.items():
            cases.append(case("moe._topk_gating_kernel", label, dt, _TOPK, TOP_K=k,
                              SOFTMAX_FIRST=first, RENORMALIZE=renorm,
                              BLOCK_E=_next_pow2(experts), BLOCK_K=_next_pow2(k)))
        acts = codes if dt == "bf16" else {"silu": codes["silu"]}
        for act, code in acts.items():
            cases.append(case("moe._expert_gate_up_kernel", act, dt, _GATE_UP, ACT=code,
                              DOT_FP32=fp32, **blocks))
        for rw in dict.fromkeys(("fp32", dt)):  # fp32 once for fp32
            cases.append(case("moe._expert_down_kernel", f"rw-{rw}", dt,
                              _DOWN.replace("*R", f"*{rw}"), DOT_FP32=fp32, **blocks))
    return cases


def all_cases() -> list[AotCase]:
    """Every launch configuration the AOT test compiles (for each GPU architecture)."""
    return (_activation_cases() + _alibi_cases() + _attention_cases() + _norm_cases()
            + _rotary_cases() + _linear_cases() + _quant_cases() + _kv_quant_cases()
            + _moe_cases())


# ----------------------------------------------------------------------------- the kernels

ARCHS = (80, 90)  # GPUTarget("cuda", arch, 32): A100 (sm_80) and H100 (sm_90a)
PACKAGE = Path(importlib.util.find_spec("hf_dsinfer").submodule_search_locations[0])
# @triton.jit device functions that kernels call (compiled into them), never launched alone.
JIT_HELPERS: set[str] = set()
_JITTED = re.compile(r"@triton\.jit\b[^\n]*\n\s*def (\w+)|triton\.jit\((\w+)\)")


def jit_modules() -> list[Path]:
    """The package's source files that hand functions to triton.jit."""
    return sorted(p for p in PACKAGE.rglob("*.py") if "triton.jit" in p.read_text())


def jitted_names() -> set[str]:
    """'<module>.<function>' of every function the package's source passes to triton.jit."""
    return {f"{path.stem}.{m[1] or m[2]}" for path in jit_modules()
            for m in _JITTED.finditer(path.read_text())}


@contextlib.contextmanager
def _interpreter_off():
    """TRITON_INTERPRET=0 while kernels are jitted (triton.jit reads it at each decoration)."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


def _private_copy(path: Path):
    """A fresh module object for `path`, not registered in sys.modules."""
    spec = importlib.util.spec_from_file_location(f"_aot_copy_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def load_kernels() -> dict:
    """'<module>.<kernel>' -> JITFunction for every kernel that a `_kernels()` factory builds."""
    # Imported before the interpreter is turned off: Triton jits its standard library at import.
    from triton.runtime.jit import JITFunction

    kernels = {}
    with _interpreter_off():
        for path in jit_modules():
            factory = getattr(_private_copy(path), "_kernels", None)
            if factory is None:
                raise AssertionError(
                    f"{path} jits Triton kernels but has no `_kernels()` factory, so the AOT test "
                    "cannot build them. Fix: build them in `_kernels()` as kernels/*.py do.")
            built = factory()
            for value in built if isinstance(built, tuple) else vars(built).values():
                if isinstance(value, JITFunction):
                    kernels[f"{path.stem}.{value.fn.__name__}"] = value
    return kernels


# ----------------------------------------------------------------------------- compiling


class AotResult(NamedTuple):
    regs: int  # registers per thread (what the driver reports as Triton's n_regs)
    spills: int  # Triton's n_spills: local memory bytes per thread / 4 (0: no spills)
    shared: int  # shared memory bytes per program (metadata.shared)
    seconds: float  # wall time of the compile
    error: str | None  # the compiler's message when it failed


@functools.cache
def ptxas_for(arch: int):
    """The ptxas Triton compiles sm_<arch> with (triton ships them under
    triton/backends/nvidia/bin: `ptxas` for sm_80, `ptxas-blackwell` for sm_90 and up)."""
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        return get_ptxas(arch)
    except RuntimeError as e:
        raise RuntimeError(
            f"sm_{arch}: Triton compiles to a cubin through ptxas and found none ({e}); expected "
            "the one the triton wheel ships under triton/backends/nvidia/bin. Fix: reinstall "
            "triton, or point TRITON_PTXAS_PATH (sm_80) / TRITON_PTXAS_BLACKWELL_PATH (sm_90) "
            "at a CUDA 12.x+ ptxas.") from e


def _source(case: AotCase):
    """The ASTSource of `case`: its kernel, full signature and constexprs, aligned pointers."""
    from triton.compiler import ASTSource

    fn = load_kernels()[case.kernel]
    given = set(case.args) | set(case.constexprs)
    constexprs = {p.name for p in fn.params if p.is_constexpr}
    if given != set(fn.arg_names) or not constexprs <= set(case.constexprs):
        raise ValueError(
            f"{case.id}: the case gives {sorted(given)} (constexprs {sorted(case.constexprs)}), "
            f"the kernel takes {fn.arg_names} (constexprs {sorted(constexprs)}). Fix: update "
            "tests/kernels/triton_aot_cases.py from the kernel's launcher.")
    signature = {name: "constexpr" if name in case.constexprs else case.args[name]
                 for name in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
               if signature[name].startswith("*")}
    return ASTSource(fn, signature, case.constexprs, aligned)


_RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)")


def cubin_resources(cubin: bytes) -> tuple[int, int]:
    """(registers, local memory bytes) per thread of a one-kernel cubin, read by the cuobjdump
    Triton ships. Without a driver Triton's n_regs / n_spills are never filled in (they come
    from cuFuncGetAttribute at load time); these are the same numbers from the binary."""
    import triton

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-res-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    found = _RESOURCES.search(out)
    assert found, f"unexpected cuobjdump -res-usage output:\n{out}"
    return int(found[1]), int(found[2]) + int(found[3])


def compiler_process_init() -> None:
    """Initializer of a compile worker: Triton not imported yet, and to be imported (by
    compile_case) with the interpreter off."""
    if "triton" in sys.modules:
        raise RuntimeError("a compile worker must import Triton itself, with "
                           "TRITON_INTERPRET=0; start it with the spawn method")
    os.environ["TRITON_INTERPRET"] = "0"


def compile_case(case: AotCase, arch: int) -> AotResult:
    """Compile `case` to a cubin for sm_<arch>, in a process set up by compiler_process_init.
    A failed compile does not raise: it comes back as `error` (the compiler's message), so a
    worker process can hand it to the test that owns the case."""
    import triton.language as tl
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    interpreted_stdlib = not isinstance(tl.sigmoid, JITFunction)  # jitted at import
    if interpreted_stdlib:
        raise RuntimeError("Triton was imported with TRITON_INTERPRET=1 in this process, so its "
                           "standard library cannot be compiled. Fix: compile_case in a worker "
                           "started with compiler_process_init.")
    start = time.perf_counter()
    try:
        kernel = triton_compile(_source(case), target=GPUTarget("cuda", arch, 32),
                                options=case.options or None)
        regs, local = cubin_resources(kernel.asm["cubin"])
    except Exception as e:  # noqa: BLE001  (reported by the test that owns the case)
        return AotResult(0, 0, 0, time.perf_counter() - start, f"{type(e).__name__}: {e}")
    return AotResult(regs, local // 4, kernel.metadata.shared, time.perf_counter() - start, None)
