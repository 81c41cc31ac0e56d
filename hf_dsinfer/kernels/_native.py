"""The native CPU kernels of csrc/: built on first use, loaded with ctypes.

cpu_quant.c, the int8 matrix-vector product of decode (VNNI byte dot products, prefetch, huge
pages; see the file's header for the numerics): decode reads every weight once, so it is bound
by memory bandwidth, and torch's own CPU kernel for it is not.

cpu_moe.c, the bf16 expert MLPs of a MoE layer: all routed experts in one call, on AMX tiles
straight on the stored expert weights where the CPU has AMX-BF16 (AVX-512 BF16 dot products
elsewhere, for about one row per expert), where oneDNN runs one GEMM pair per expert. The same
file's hfd_linear_bf16 runs dense bf16 linears of 2-256 rows (batched decode, short prefills)
on AMX straight from the row-major weight, which oneDNN reorders on every call. torch has no
such path and no maintained library adds one to torch, so they are ours.

cpu_qgemm.c, 4-bit weights times many rows of bf16 x (batched decode, continuous batching's
packed steps): a panel of weight rows dequantized to bf16 in cache at a time, where dequantizing
the whole weight for a GEMM writes and reads it through memory.

cpu_experts.c, bf16 products of a few rows of x with a weight stored [in, out] (gpt-oss's
experts) or [out, in] (nn.Linear's), reading the weight once at the memory's pace, where torch's
bf16 kernels for one row read it at a fraction of it (docs/performance.md).

cpu_decode.c, one Llama-family decoder layer for one token in two calls (kernels/decode.py):
batch-1 decode is bound by the weight reads, and computed with torch ops each layer also pays
~60 dispatches around them. Its batched variant takes one token of each of up to 256
sequences, bf16 projections through hfd_linear_bf16.

What each of them measured against the path it replaced: docs/performance.md.

Build: gcc -O3 and OpenMP, once per machine and ISA tier, into
~/.cache/hf_dsinfer/native/<hash of sources, flags and tier>/ (HF_DSINFER_CACHE moves the root); a
concurrent build in another process is harmless (atomic rename). OpenMP links to libgomp.so.1,
which is the runtime torch has already loaded, so both share one thread pool.

ISA tiers (TIERS, lowest first): generic (no -m flags: baseline x86-64, or aarch64 with NEON),
avx2 (AVX2, FMA, F16C), avx2_vnni (+ AVX-VNNI: Intel's client CPUs from Alder Lake, AMD's from
Zen 5; a branch off avx2, which the avx512 tiers do not include, since Skylake-SP to Ice Lake
lack it), avx512 (F, BW, VL, VNNI), avx512_bf16 (+ BF16), amx (+ AMX tiles, used where Linux
grants the tile state; HF_DSINFER_NATIVE_AMX=0 keeps AVX-512). The kernels are
written once with AVX-512 intrinsics; a tier without an instruction gets SIMDe's emulation of it
(see csrc/hfd_simd.h), with the same numbers, except the int8 / int4 / bf16 dot products of the
avx2 tiers, which have 256-bit loops of their own (csrc/hfd_avx2.h; avx2_vnni's integer dot
products by vpdpbusd / vpdpwssd), again with the same numbers. The best tier the CPU has (and
the compiler builds) is used; HF_DSINFER_ISA=<tier> caps it (tests run every tier the machine
has this way).

`lib()` returns None, and callers use torch's kernels, when:
    HF_DSINFER_NATIVE=0 is set, or
    no C compiler is found, the SIMDe headers (simde-py) are missing, or the build fails (the
    reason is in `why_unavailable()`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from hf_dsinfer import settings
from hf_dsinfer.errors import NativeABIError
from hf_dsinfer.kernels import abi

ENV_VAR = settings.ENV["native"]  # the switches are hf_dsinfer.settings; these are its defaults
AMX_ENV_VAR = settings.ENV["amx"]  # 0: the kernels that can use AMX tiles keep AVX-512
ISA_ENV_VAR = settings.ENV["isa"]  # caps the tier: one of TIERS
CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("cpu_quant.c", "cpu_moe.c", "cpu_decode.c",
                                    "cpu_experts.c", "cpu_qgemm.c")]
HEADERS = [CSRC / name for name in ("hfd_simd.h", "hfd_avx2.h", "hfd_api.h")]
# -ffp-contract=off: a product and a sum stay two roundings on every target (hfd_simd.h)
BASE_FLAGS = ["-O3", "-fPIC", "-shared", "-fopenmp", "-Wno-psabi", "-ffp-contract=off"]
TIERS = settings.TIERS
# per tier: what it adds to the one below, as gcc flags and as /proc/cpuinfo flags
_TIER_ADDS = {
    "generic": ((), ()),
    "avx2": (("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
    "avx2_vnni": (("-mavxvnni",), ("avx_vnni",)),
    "avx512": (("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
               ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")),
    "avx512_bf16": (("-mavx512bf16",), ("avx512_bf16",)),
    "amx": (("-mamx-tile", "-mamx-bf16", "-mamx-int8"), ("amx_tile", "amx_bf16", "amx_int8")),
}
# dtype codes of the C functions
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_why: dict[str, str] = {}  # tier -> why its library did not load


# the tier each one adds to (a tree: avx2_vnni is a branch off avx2, which avx512 extends)
_PARENT = {"generic": None, "avx2": "generic", "avx2_vnni": "avx2", "avx512": "avx2",
           "avx512_bf16": "avx512", "amx": "avx512_bf16"}


def _cumulative(index: int) -> tuple[list[str], list[str]]:
    """gcc flags and cpuinfo flags of TIERS[index], its own plus those of the tiers it extends."""
    line, name = [], TIERS[index]
    while name is not None:
        line.append(name)
        name = _PARENT[name]
    gcc, cpu = [], []
    for name in reversed(line):
        gcc += _TIER_ADDS[name][0]
        cpu += _TIER_ADDS[name][1]
    return gcc, cpu


def tier_flags(tier: str) -> list[str]:
    """The gcc flags that build `tier`."""
    return BASE_FLAGS + _cumulative(TIERS.index(tier))[0]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _compiler_takes(flags: tuple[str, ...]) -> bool:
    """Whether compiler() accepts these -m flags (gcc 9 lacks -mavx512bf16, gcc 10 -mavxvnni
    and the AMX ones): a tier it cannot build is not this machine's. True without a compiler
    (the build then says why)."""
    cc = compiler()
    if cc is None or not flags:
        return True
    try:
        proc = subprocess.run([cc, *flags, "-E", "-x", "c", os.devnull], capture_output=True,
                              check=False, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return True
    return proc.returncode == 0


@functools.lru_cache(maxsize=1)
def runnable_tiers() -> tuple[str, ...]:
    """The tiers this CPU has (each with every tier it extends) and the compiler builds, lowest
    first: generic alone on a CPU that is not x86-64."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ("generic",)
    flags = _cpu_flags()
    return tuple(name for index, name in enumerate(TIERS)
                 if all(f in flags for f in _cumulative(index)[1])
                 and _compiler_takes(_TIER_ADDS[name][0]))


@functools.lru_cache(maxsize=1)
def cpu_tier() -> str:
    """The best tier this CPU runs (generic on a CPU that is not x86-64)."""
    return runnable_tiers()[-1]


def capped(cap: str) -> str:
    """The tier that runs when the settings cap it at `cap`: the best this CPU has at or below
    it (on a CPU without AVX-VNNI, a cap of avx2_vnni runs avx2). Asked on every lib() call
    under a cap, so cached per (cap, this CPU's best tier)."""
    return _capped(cap, cpu_tier(), runnable_tiers())


@functools.lru_cache(maxsize=64)
def _capped(cap: str, best: str, runnable: tuple[str, ...]) -> str:
    top = min(TIERS.index(cap), TIERS.index(best))
    return [t for t in runnable if TIERS.index(t) <= top][-1]


def _cache_root() -> Path:
    return settings.current().cache_dir


def _simde_include() -> str:
    try:
        import simde_py
    except ImportError as err:
        raise RuntimeError("the SIMDe headers are missing: pip install simde-py") from err
    return simde_py.get_include()


def compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else gcc or cc on PATH."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def build(level: str, cc: str | None = None, defines: tuple[str, ...] = ()) -> Path:
    """Compile the sources for `level` (a tier) once with `cc` (default: compiler()); the path
    of the library. A cross compiler builds the tier for its own target (generic, the one tier
    without x86 flags, for aarch64: tests/kernels/test_native_arm64.py); each compiler's library
    is cached apart. defines: preprocessor names set for the build, for the tests (csrc/hfd_simd.h:
    HFD_EMULATE_AVX_VNNI); each set is cached apart too."""
    source = b"".join(path.read_bytes() for path in (*HEADERS, *SOURCES))
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    flags = [*tier_flags(level), *(f"-D{name}" for name in defines), "-I", _simde_include()]
    key = hashlib.sha256(source + " ".join([cc, *flags]).encode()).hexdigest()[:16]
    target = _cache_root() / "native" / f"{level}-{key}" / "libhfd_cpu.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, *map(str, SOURCES), "-o", tmp, "-lm"],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: a reader never sees a half-written library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.hfd_int8_gemv.argtypes = [p, i32, p, p, p, p, i32, p, i32, p, i64, i64, i64, i32, i32]
    lib.hfd_int8_gemv.restype = i32
    lib.hfd_advise_hugepages.argtypes = [p, i64]
    lib.hfd_avx2_dots.argtypes = []
    lib.hfd_avx2_dots.restype = i32
    lib.hfd_moe_bf16.argtypes = [p, p, p, p, i64, i64, i64, p, p, p, i32, i32, i32]
    lib.hfd_moe_bf16.restype = i32
    lib.hfd_linear_bf16.argtypes = [p, p, p, p, i64, i64, i64, i32]
    lib.hfd_linear_bf16.restype = i32
    lib.hfd_matmul_kn_bf16.argtypes = [p, p, p, p, p, i64, i64, i64, i32]
    lib.hfd_matmul_kn_bf16.restype = i32
    lib.hfd_gemv_bf16.argtypes = [p, p, p, p, i64, i64, i64, i32]
    lib.hfd_gemv_bf16.restype = i32
    lib.hfd_amx_available.argtypes = []
    lib.hfd_amx_available.restype = i32
    lib.hfd_advise_hugepages.restype = i32
    lib.hfd_decode_attn_in.argtypes = [p, p, p, p, p, p, p, i32]
    lib.hfd_decode_attn_in.restype = i32
    lib.hfd_decode_attn_out.argtypes = [p, p, p, p, i64, i64, p, i64, i64, i64, p, p, i32]
    lib.hfd_decode_attn_out.restype = i32
    lib.hfd_decode_attn_out_slots.argtypes = [p, p, p, p, i64, i64, p, i64, i64, i64, p, p, p,
                                              i32]
    lib.hfd_decode_attn_out_slots.restype = i32
    lib.hfd_decode_layers.argtypes = [p, i64, p, p, p, p, p, p, i64, p, p, i32]
    lib.hfd_decode_layers.restype = i32
    lib.hfd_int4_linear.argtypes = [p, i32, i64, p, p, p, i32, i64, i64, i64, i32, p, i32]
    lib.hfd_int4_linear.restype = i32
    lib.hfd_rms_rows_bf16.argtypes = [p, i64, i64, p, ctypes.c_float, i32, p, i32]
    lib.hfd_rms_rows_bf16.restype = i32
    lib.hfd_exp_f32.argtypes = [p, i64, p]
    lib.hfd_exp_f32.restype = i32
    lib.hfd_rope_rows_bf16.argtypes = [p, i64, i64, i64, i64, i64, p, p, i64, i32]
    lib.hfd_rope_rows_bf16.restype = i32
    lib.hfd_attend_rows.argtypes = [p, i64, i64, p, i64, i64, p, i64, i64, p, i64, i64, i64,
                                    i64, p, i64, ctypes.c_float, ctypes.c_float, p, i64, i64,
                                    p, i32]
    lib.hfd_attend_rows.restype = i32
    lib.hfd_int4_gemm_bf16.argtypes = [p, i64, p, p, p, i32, i64, i64, i64, i32, p, i32]
    lib.hfd_int4_gemm_bf16.restype = i32
    lib.hfd_int4_gemm_a8.argtypes = [p, i32, i64, p, p, p, i32, i64, i64, i64, i32, p, i32]
    lib.hfd_int4_gemm_a8.restype = i32
    lib.hfd_int4_a8_rows.argtypes = [p, i32, i64, p, p, p, i32, i64, i64, i64, i32, p, i32]
    lib.hfd_int4_a8_rows.restype = i32
    lib.hfd_int8_gemm_bf16.argtypes = [p, i64, p, p, i32, i64, i64, i32, p, i32]
    lib.hfd_int8_gemm_bf16.restype = i32
    lib.hfd_gemm_bf16.argtypes = [p, p, p, p, i64, i64, i64, i32]
    lib.hfd_gemm_bf16.restype = i32
    lib.hfd_int8_amx.argtypes = [p, i32, p, p, p, p, i32, p, i32, p, i64, i64, i64, i32]
    lib.hfd_int8_amx.restype = i32
    lib.hfd_int4_amx.argtypes = [p, i64, p, p, p, i32, i64, i64, i64, i32, p, i32]
    lib.hfd_int4_amx.restype = i32
    lib.hfd_amx_int8_available.argtypes = []
    lib.hfd_amx_int8_available.restype = i32
    lib.hfd_decode_attn_in_rows.argtypes = [p, i64, p, p, p, i64, p, p, p, p, i32]
    lib.hfd_decode_attn_in_rows.restype = i32
    lib.hfd_decode_attn_out_rows.argtypes = [p, i64, p, p, p, i64, i64, i64, p, i64, i64, i64,
                                             i64, p, i64, p, p, i32]
    lib.hfd_decode_attn_out_rows.restype = i32
    lib.hfd_decode_post_attn_rows.argtypes = [p, i64, p, p, p, p, i32]
    lib.hfd_decode_post_attn_rows.restype = i32
    lib.hfd_dequant_int4_rows.argtypes = [p, p, p, i32, i64, i64, i64, i64, p, i32, i32, i32]
    lib.hfd_dequant_int4_rows.restype = i32
    lib.hfd_dequant_int8_rows.argtypes = [p, p, i32, p, i64, i64, i64, p, i32, i32, i32]
    lib.hfd_dequant_int8_rows.restype = i32
    lib.hfd_dequant_kv_int4.argtypes = [p, p, p, i64, i64, i64, i64, i64, i64, p, i32, i64, i32]
    lib.hfd_dequant_kv_int4.restype = i32
    lib.hfd_quant_kv_int4.argtypes = [p, i32, i64, i64, i64, p, p, p, i32]
    lib.hfd_quant_kv_int4.restype = i32
    lib.hfd_attend_kv_int4.argtypes = [p, i32, p, i32, i64, i64, i64, i64, i64, p, i64,
                                       ctypes.c_float, i32, p, i32, i32]
    lib.hfd_attend_kv_int4.restype = i32


@functools.cache
def _load(level: str) -> ctypes.CDLL | None:
    try:
        path = build(level)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError) as err:
        _why[level] = f"build failed: {err}"
        return None
    try:
        abi.check(lib, str(path))
    except NativeABIError as err:
        _why[level] = str(err)
        return None
    _declare(lib)
    return lib


# The lowest tier at which each use of the kernels measured faster than the torch path it
# replaces; below it lib(use) is None unless the settings name a tier (isa). The measurements
# (an AVX-512 EPYC made to run as an AVX2 CPU, 2026-11-24) are in docs/performance.md.
#   "kernels": the decode layer and MoE experts against torch's ops
#   "gemv": the int8 GEMV as a linear of its own (an output head, torch-path layers); from avx2
#       since the avx2 tier has loops of its own (csrc/hfd_avx2.h)
#   "int4": int4 products against torch's int4 kernel (likewise)
#   "dequantize": weight rows for the GEMMs of a prefill, 512 rows at a time: from avx2 since
#       the avx2 tiers' own bf16 rounding (2026-11-25: a 5632 x 2048 int4 / int8 linear of 1024
#       and 2048 rows 1.01-1.09x with them, the same bits; 0.53x before, a 128-token int8
#       prefill, when SIMDe emulated the rounding)
#   "codes": KV-cache codes, and int4 products on codes torch's kernel has no copy of (tiles, the
#       offload engine's row-major codes, where the alternative is dequantize + GEMM)
#   "bf16_gemv": bf16 products of a few rows (csrc/cpu_experts.c, and cpu_qgemm.c's panel
#       kernel past them) against torch's bf16 kernels: measured on Zen 5 (avx512_bf16), and at
#       avx2 on that CPU with torch and oneDNN capped to AVX2 (2026-11-25, kernels/crossovers.py:
#       the AVX2 loops of csrc/hfd_avx2.h and cpu_qgemm.c; GEMV 2-4 rows 1.4-2.3x F.linear, 1 row
#       0.91x; panel 4-512 rows 1.4-3.5x)
#   "rows": RoPE and RMSNorm of many bf16 rows (csrc/cpu_decode.c: hfd_rope_rows_bf16,
#       hfd_rms_rows_bf16) against torch's ops: 2x faster at avx512 and avx512_bf16 (256 rows
#       of 2048, Zen 5), 8-11x slower at avx2, where SIMDe emulates their 512-bit vectors; with
#       the avx2 tiers' own bf16 rounding (2026-11-25) still 0.4-0.8x (RMSNorm) and 0.93-0.97x
#       (RoPE) at avx2_vnni, 16-256 rows (docs/performance.md)
#   "a8": 4-bit weights times 8-bit activations (csrc/cpu_qgemm.c: hfd_int4_gemm_a8) against
#       its torch reference (an fp32 einsum of the integer codes), measured on Zen 4 capped to
#       each tier with torch and oneDNN capped alike (2026-11-27, a 5632 x 2048 weight, 32 and
#       128 rows): avx2, with loops of its own (vpmaddubsw), 4.1-12.2 ms against the reference's
#       45-400 and the W4A16 panel path's 7.0-28.7; generic level with the reference (142-549
#       against 149-475 ms), so the reference runs there
#   "panel": 4-bit and int8 weights times many bf16 rows, a panel dequantized in cache at a time
#       (csrc/cpu_qgemm.c), against dequantize + GEMM: measured on Zen 5 (avx512_bf16), and at
#       avx2 as above (the table look-ups still emulated there; the panels win from 128-256
#       rows, kernels/crossovers.py)
# Matrix kernels of the generic tier were not measured on a CPU whose best tier is generic
# (aarch64, pre-AVX2 x86); capped there on x86 they are far slower than torch's.
MIN_TIER = {"kernels": "avx2", "gemv": "avx2", "int4": "avx2", "dequantize": "avx2",
            "codes": "generic", "bf16_gemv": "avx2", "panel": "avx2", "rows": "avx512",
            "a8": "avx2"}


def _running() -> tuple[str, bool]:
    """The tier the kernels run (see tier()) and whether the settings named one (isa)."""
    cap = settings.current().isa
    best = cpu_tier()
    if cap is None:
        return best, False
    return capped(cap), True


@torch.compiler.assume_constant_result  # traced (kernels.crossovers): a constant of the graph
def tier() -> str:
    """The tier the kernels run: the CPU's best, capped by the settings' isa."""
    return _running()[0]


def _below_min(level: str, named: bool, use: str) -> bool:
    return not named and TIERS.index(level) < TIERS.index(MIN_TIER[use])


def lib(use: str = "kernels") -> ctypes.CDLL | None:
    """The loaded library of the running tier for `use` (a MIN_TIER key), or None when the
    native kernels do not run here, or run slower than torch's path at this tier. None inside
    a torch.compile trace: a ctypes call cannot be traced."""
    if torch.compiler.is_compiling() or not settings.current().native:
        return None
    level, named = _running()
    return None if _below_min(level, named, use) else _load(level)


def available() -> bool:
    return lib() is not None


def builds() -> bool:
    """The library of this CPU's best tier builds and loads (whether or not lib() uses it)."""
    return _load(cpu_tier()) is not None


def why_unavailable(use: str = "kernels") -> str | None:
    """Why `lib(use)` is None (None when it is not)."""
    if not settings.current().native:
        return f"disabled by settings native=False ({ENV_VAR}=0)"
    level, named = _running()
    if _below_min(level, named, use):
        return (f"the {level} tier, where {use!r} kernels measured slower than torch's path "
                f"(they run from {MIN_TIER[use]}: _native.MIN_TIER); settings isa={level!r} "
                f"({ISA_ENV_VAR}={level}) runs them anyway")
    return None if _load(level) is not None else f"{level} tier: {_why.get(level, '')}"


def describe_tier() -> str:
    """One line for explain: the tier the native kernels run, and what they leave to torch."""
    if lib("codes") is None:  # the use that runs at every tier
        return f"native kernels off: {why_unavailable('codes')}"
    level, best = tier(), cpu_tier()
    capped = (f", capped by settings isa ({ISA_ENV_VAR}; this CPU: {best})" if level != best
              else "")
    off = [f"{use} ({why_unavailable(use)})" for use in MIN_TIER if lib(use) is None]
    return f"native kernels: {level} tier{capped}" + (f"; torch's path for {'; '.join(off)}"
                                                        if off else "")


# Tensors from this size up are placed on transparent huge pages by `streamed_copy`.
HUGEPAGE_MIN_BYTES = 4 << 20


def streamed_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor `t` whose memory was advised for transparent huge pages
    before being written (the native kernels stream such weights faster; see csrc/). `t` itself
    when the library is unavailable or `t` is small."""
    library = lib()
    nbytes = t.numel() * t.element_size()
    if library is None or t.device.type != "cpu" or nbytes < HUGEPAGE_MIN_BYTES:
        return t.contiguous()
    out = torch.empty(t.shape, dtype=t.dtype)
    library.hfd_advise_hugepages(out.data_ptr(), nbytes)  # refusal only costs speed
    return out.copy_(t)


def amx_allowed() -> bool:
    """AMX may be used where the CPU has it (the C side checks the CPU and asks Linux for the
    tile state); settings amx=False (HF_DSINFER_NATIVE_AMX=0) keeps the AVX-512 paths."""
    return settings.current().amx


def amx_available() -> bool:
    """The native kernels will use AMX tiles here (allowed, CPU has AMX-BF16, Linux grants the
    tile state)."""
    library = lib()
    return library is not None and amx_allowed() and bool(library.hfd_amx_available())


def amx_int8_available() -> bool:
    """The int8 linear of many rows runs on AMX-INT8 tiles here (allowed, CPU has AMX-INT8,
    Linux grants the tile state)."""
    library = lib()
    return library is not None and amx_allowed() and bool(library.hfd_amx_int8_available())


def check(code: int, name: str) -> None:
    if code != 0:
        raise RuntimeError(f"native kernel {name} returned {code} (bad shape or out of memory)")
