"""Row counts at which the CPU linears hand over from one kernel to the next, per ISA tier.

Which kernel is fastest for an x of M rows depends on the CPU: a matrix-vector kernel that
streams the weight once wins at few rows, torch's packed kernels or tiles at more, a dequantized
weight and a GEMM at many. The crossovers are data, one row per tier of the native kernels
(_native.TIERS), each value with the machine it was measured on; `rows()` gives the row of the
tier that runs (_native.tier(): the CPU's best, capped by HF_DSINFER_ISA), so a capped test runs
the lower tier's dispatch too. benchmarks/crossovers.py measures them (medians of interleaved
repeats per tier, the candidate paths side by side); the table below says where each came
from, and which values no measurement backs (inherited from the tier above, or from the Xeon).

Whether a use of the native kernels runs at a tier at all is _native.MIN_TIER's; these rows
bound how many rows it takes where it runs. Below its MIN_TIER a kernel runs only when
HF_DSINFER_ISA names the tier (tests), and the row keeps the bound of the tier above.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hf_dsinfer.kernels import _native


@dataclass(frozen=True)
class Crossovers:
    int8_gemv_max_rows: int  # native int8 GEMV (csrc/cpu_quant.c) for 1..this many rows
    int8_pack_max_rows: int  # torch's _weight_int8pack_mm up to this; then dequantize + GEMM
    int4_native_max_rows: int  # native int4 linear (csrc/cpu_decode.c) for 1..this many rows
    int4_pack_max_rows: int  # torch's _weight_int4pack_mm_for_cpu up to this; then dequantize
    # AMX tiles (the amx tier only; None elsewhere): bf16 linears of 2..amx_bf16_max_rows rows
    # (kernels/linear.py), int8 linears of amx_int8_min_rows..amx_int8_max_rows (quant.py)
    amx_bf16_max_rows: int | None = None
    amx_int8_min_rows: int | None = None
    amx_int8_max_rows: int | None = None
    # int4 linears of int4_native_max_rows + 1 .. this many bf16 rows on AMX-BF16 tiles, a panel
    # of the weight dequantized in cache at a time (csrc/cpu_moe.c: hfd_int4_amx; quant.py)
    amx_int4_max_rows: int | None = None
    # native bf16 GEMV (csrc/cpu_experts.c, hfd_gemv_bf16) for 1..this many bf16 rows of a
    # linear (kernels/linear.py). None: not measured on that tier's machine (the Xeon): torch.mv
    # for one row and the AMX linear above keep their rows there
    bf16_gemv_max_rows: int | None = None
    # native int4 x bf16 kernel that dequantizes panels of the weight in cache (csrc/cpu_qgemm.c)
    # for int4_native_max_rows + 1 .. this many bf16 rows (kernels/quant.py); None: not measured
    # on that tier's machine, dequantize + GEMM there
    int4_gemm_max_rows: int | None = None
    # native int8 x bf16 panel kernel (csrc/cpu_qgemm.c, hfd_int8_gemm_bf16) after the GEMV's
    # rows up to this many bf16 rows (kernels/quant.py); None: not measured there
    int8_gemm_max_rows: int | None = None
    # native bf16 panel kernel (csrc/cpu_qgemm.c, hfd_gemm_bf16) for bf16_gemv_max_rows + 1 ..
    # this many bf16 rows of a linear (kernels/linear.py); None: not measured there
    bf16_gemm_max_rows: int | None = None
    # W4A8 (quant act_bits=8): the batch-1 kernel (csrc/cpu_decode.c, hfd_int4_a8_rows) for
    # 1..this many rows, then the panel kernel (csrc/cpu_qgemm.c, hfd_int4_gemm_a8); both give
    # the same bits, so this moves only time (kernels/quant.py: linear_int4_a8_cpu)
    a8_rows_max_rows: int = 1

    def int4_codes_max_rows(self, dtype) -> int:
        """The most rows of x in `dtype` that a kernel reading the 4-bit codes as stored takes
        (more: dequantize + GEMM, which the offload engine does once per prefill): the panel
        kernel's and, where the CPU grants AMX tiles, the AMX kernel's bf16 rows too."""
        bf16 = dtype == torch.bfloat16
        gemm = self.int4_gemm_max_rows if bf16 else None
        amx = self.amx_int4_max_rows if bf16 and _native.amx_available() else None
        return max(self.int4_native_max_rows, gemm or 0, amx or 0)


# The 2-core Xeon with AMX-BF16/INT8 (480 MB L3) of NOTES.md, 2 threads, weights cycled past
# the L3; the measurements are in the comments of kernels/quant.py and kernels/linear.py.
# Measured again there on 2026-11-25 with benchmarks/crossovers.py (`--tiers amx`, medians of
# 5; table in docs/performance.md): int4 native 32 and int4 pack 32 as below. The panel
# kernels never won (int4 / int8 panel 0; bf16 panel 8 against oneDNN's AMX F.linear, not
# against the AMX linear that takes 2-256 rows here), so their bounds stay None. The int8 GEMV
# won up to 32 rows against the vector paths. It is kept at 16: AMX-INT8 takes 4-256 rows
# wherever AMX is allowed.
# 2026-11-25 (afternoon), the same Xeon, with the int4 AMX kernel (csrc/cpu_moe.c:
# hfd_int4_amx), quiet (load ~0.5), 2 threads, medians of 5 (`python benchmarks/crossovers.py
# --tiers amx --reps 5 --rows 1 2 4 6 8 12 16 24 32 48 64 128 256 512`, then `--reps 3 --rows 8
# 12 16 512 1024 2048 4096`), ms at 1 / 6 / 8 / 16 / 64 / 256 / 512 / 1024 / 2048 rows: int4 AMX
# 1.12 / 1.37 / 1.39 / 1.45 / 2.01 / 3.96 / 7.31 / 18.2 / 36.5 against the int4 native kernel
# 0.48 / 1.07 / 1.38 / 2.51 / 10.0 / 51.5 / 130 / 279 / 566 and dequantize + GEMM 3.84 / 3.81 /
# 3.84 / 3.81 / 5.71 / 10.4 / 18.7 / 31.1 / 31.3 (bf16 F.linear 1.61 / 1.83 / 1.77 / 1.81 / 2.41
# / 5.17 / 9.37 / 17.2 / 23.3; the bf16 AMX linear 0.97 / 1.05 / 0.98 / 1.05 / 1.25 / 3.28 /
# 6.70 / 13.0 / 25.1): int4 native 8 (level with AMX there), int4 AMX to 1024.
# Again after the two-group dequantization tables (cpu_qgemm.c: dequant_row; `--reps 5 --rows 1
# 4 6 8 12 16 32 64 256 1024 2048`, load ~1), ms at 1 / 6 / 8 / 16 / 32 / 64 / 256 / 1024 / 2048
# rows: int4 AMX 0.99 / 1.26 / 1.22 / 1.25 / 1.21 / 1.86 / 3.86 / 15.2 / 30.5, int4 native 0.47 /
# 1.06 / 1.35 / 2.51 / 4.66 / 9.95 / 47.3 / 247 / 511, dequantize + GEMM 3.78 / 3.78 / 3.79 /
# 3.83 / 4.24 / 5.67 / 10.0 / 30.5 / 32.9: int4 native 6, int4 AMX to 2048 (kept at 1024: the
# first run had dequantize + GEMM ahead at 2048).
# Again with the next block dequantized between the tile steps (cpu_moe.c: dq_job; `--reps 5
# --rows 1 6 8 16 32 64 256 1024`, twice): int4 AMX 1.12 / 1.09 / 1.00 / 1.12 / 1.15 / 1.68 / 3.58
# / 16.2 ms at 1 / 6 / 8 / 16 / 32 / 64 / 256 / 1024 rows, against the int4 native kernel's
# 0.47 / 1.11 / 1.39 / 2.48 and the bf16 AMX linear's 0.98 / 1.01 / 1.00 / 0.96 / 1.11 / 1.18 /
# 3.40 / 12.9: the bounds stay.
XEON = Crossovers(int8_gemv_max_rows=16, int8_pack_max_rows=32, int4_native_max_rows=6,
                  int4_pack_max_rows=32, amx_bf16_max_rows=256, amx_int8_min_rows=4,
                  amx_int8_max_rows=256, amx_int4_max_rows=1024)

# The tiers below amx: benchmarks/crossovers.py on a 2-core AMD EPYC Zen 5 (AVX-512 with VNNI and
# BF16, no AMX, 32 MB L3), 2026-11-24: one 5632 x 2048 weight (Llama-1.1B's MLP) of 8 copies
# cycled, bf16 x, int4 group 32, 1 thread (the machine was shared with other jobs, load 4-6 on
# its 2 cores: 2-thread timings there were scheduler noise), medians of 9 interleaved repeats.
# Each lower tier by capping that CPU: the native kernels built for the tier and torch's dispatch
# capped to match (ATEN_CPU_CAPABILITY), so "avx2" imitates an AVX2 CPU with Zen 5's memory, and
# "generic" a CPU without AVX2. ms at 1 / 4 / 16 / 32 rows:
#   avx512_bf16: int8 GEMV 0.36 / 0.77 / 2.07 / 7.66 (noise; 48 rows 5.25), dequantize + GEMM
#       3.08 / 2.89 / 7.23 / 4.07, _weight_int8pack_mm (on a row-major copy of the tiles)
#       1.58 / 1.69 / 7.09 / 5.11; int4 native 0.28 / 0.79 / 2.12 / 7.88, dequantize + GEMM
#       2.26 / 4.95 / 2.73 / 7.52, _weight_int4pack_mm_for_cpu 0.32 / 0.53 / 2.04 / 7.38.
#       Crossovers: GEMV 48, int8 pack 16, int4 native 16, int4 pack 32.
#   avx512 (the same code for these paths; a separate run): GEMV 0.38 / 0.78 / 2.43 / 4.41,
#       dequantize 3.71 / 2.89 / 4.67 / 4.08; int4 native 0.27 / 0.78 / 2.13 / 6.16, dequantize
#       3.01 / 2.23 / 3.61 / 4.11. Crossovers: GEMV 24, int8 pack 24, int4 native 24, pack 32.
#   Both avx512 tiers took the lower of the two runs (the differences are noise); avx512_bf16
#   now takes the quiet run below.
#   avx2 (SIMDe's emulation of the AVX-512 loops then): GEMV 1.23 / 6.46 at 1 / 4 rows against _weight_int8pack_mm 0.91 / 1.43 (the GEMV does
#       not run here by default: MIN_TIER), which the chunked path passes after 12 rows (3.94
#       vs 6.63 at 12, 6.47 vs 5.56 at 16); int4 native 4.00 / 13.10 / 55.5, dequantize
#       11.5 / 12.1 / 12.3: 3 rows; _weight_int4pack_mm_for_cpu up to 32 rows (12.1 vs 13.9).
#   generic: GEMV 15.8 ms at 1 row against torch's int8 kernel 11.8 and dequantize + GEMM
#       17.2 (20.3 at 2 rows, where the packed kernel takes 23.5); int4 native 29.0 / 60.2 at 1 /
#       2 rows, dequantize 33.8 / 35.1; _weight_int4pack_mm_for_cpu 24.5 / 46.5.
#   avx2 again with the tier's own int8 / int4 loops (csrc/hfd_avx2.h), 2026-11-24, the same
#       weight and method but load 14-15 on the 2 cores: minimum of 5 interleaved repeats (the
#       medians were scheduler noise, and so is every time above ~3 ms). int8 GEMV 0.44 / 0.82 /
#       1.49 ms at 1 / 2 / 4 rows against _weight_int8pack_mm 0.83 / 0.86 / 1.51 (2.86 at 8, on
#       a row-major weight: from the tiles it stores now it also copies them); int4 native 0.45 /
#       0.79 / 1.56 / 2.73 at 1 / 2 / 4 / 8 rows, against dequantize + GEMM (its only
#       alternative on tiles) 58-63 here, 11.5-12.3 on the quiet machine above. The GEMV
#       bound (16) and the int4 bound (24) extrapolate the kernels' linear cost per row
#       (~0.37-0.39 ms) to those alternatives (the GEMV ~6 ms at 16 rows, where the quiet run
#       above had _weight_int8pack_mm at 6.47 and dequantize + GEMM at 5.56); measure them
#       again on a quiet machine.
#   avx512_bf16 again, with the panel kernels (csrc/cpu_qgemm.c), 2026-11-24 (evening), quiet
#       machine (load ~1), 2 threads, the same weight (8 copies cycled), group 32, medians of 7
#       (`python benchmarks/crossovers.py --tiers avx512_bf16 --reps 7 --rows 1 2 4 6 8 12 16
#       24 32 48 64 128 256 384 512`; the dequantize paths on the codes as this tier stores
#       them, tiles). ms at 1 / 8 / 16 / 24 / 32 / 64 / 256 / 512 rows:
#       int8 GEMV 0.32 / 0.70 / 1.17 / 1.62 / 2.06 / 3.88 / 15.9 / 34.3, panel kernel 1.57 /
#       1.32 / 1.51 / 1.65 / 1.90 / 2.68 / 7.70 / 14.3, dequantize + GEMM 2.33 / 2.30 / 2.56 /
#       2.78 / 2.76 / 3.49 / 7.98 / 14.4, _weight_int8pack_mm 1.11 / 1.47 / 2.02 / 2.55 / 3.05
#       / 5.12 / 17.7 / 34.0; int4 native 0.21 / 0.74 / 1.24 / 1.74 / 2.24 / 4.20 / 20.4 / 40.0,
#       panel kernel 0.59 / 0.75 / 0.93 / 1.13 / 1.38 / 2.15 / 7.11 / 13.8, dequantize + GEMM
#       2.27 / 2.31 / 2.46 / 2.69 / 2.94 / 3.70 / 8.22 / 14.4, _weight_int4pack_mm_for_cpu 0.19
#       / 0.57 / 1.11 / 1.64 / 2.20 / 4.34 / 17.3 / 34.3. Past 512 rows dequantize + GEMM wins
#       (2048 rows: int4 panel 65 ms against 52: the panels read all of x each).
#       Crossovers: int8 GEMV 24, int8 panel 512, int8 pack 24, int4 native 8, int4 panel 512,
#       int4 pack 32 (the values below; the loaded run above had given 48 / - / 16 / 16 / - /
#       32).
# A value a tier does not use by default is inherited: the generic tier's GEMV bound is
# avx2's (MIN_TIER), used only when HF_DSINFER_ISA names the tier.
# bf16 panel kernel (csrc/cpu_qgemm.c) against F.linear, the same weight (8 copies cycled, on
# huge pages as the model stores them), 2 threads, quiet, medians of 7, ms at 5 / 8 / 16 / 32 /
# 64 / 256 rows: 0.60 / 0.71 / 0.88 / 1.37 / 2.22 / 7.56 against 0.77 / 0.83 / 0.99 / 1.37 /
# 2.05 / 6.37: bf16_gemm_max_rows 16 then. Timed by benchmarks/crossovers.py since 2026-11-24
# (late night, load 1.1-1.5, medians of 7 and 9: `--tiers avx512_bf16 --reps 7 --rows 1 4 8
# 12 16 24 32 48 64 96`): 16 / 24 / 32 / 48 / 64 rows 0.91 / 1.09 / 1.37 / 1.74 / 2.20 against
# F.linear's 1.08 / 1.21 / 1.46 / 1.80 / 2.17 (second run 0.95 / 1.14 / 1.42 / 1.75 / 2.24
# against 1.06 / 1.23 / 1.46 / 1.79 / 2.17), which would give 48; but end to end 48 made
# `hf-dsinfer serve` on SmolLM2 slower (16 clients: 311-326 tok/s against 370 with 16, same
# hour; cause not found; docs/performance.md), so bf16_gemm_max_rows stays 16.
# bf16 GEMV (1 thread, load 6-10, weights cycled past the L3; 1 row): 1024 x 1024 native 86 us
# against F.linear 570 and torch.mv 653; 2816 x 1024 224 / 1286 / 1785; 32000 x 1024 7.7 /
# 12.9 / 21.4 ms; at 4 rows see docs/performance.md. The kernel takes at most 4 rows.
# A Zen 4 (EPYC Genoa: AVX-512 BF16 and VNNI in 256-bit halves, no AVX-VNNI), 2026-11-27, quiet,
# 2 threads (`--tiers avx512_bf16 --reps 7 --rows 1 4 6 8 12 16 24 32`), ms at 1 / 8 / 12 / 16 /
# 32 rows: int8 GEMV 0.38 / 1.52 / 1.98 / 2.33 / 4.99, int8 panel 1.28 / 1.95 / 1.80 / 2.32 /
# 3.21; int4 native 0.35 / 1.24 / 1.77 / 2.30 / 4.55, int4 panel 0.75 / 1.22 / 1.42 / 1.59 /
# 2.74; bf16 panel 0.69 / 1.22 / 1.31 / 1.62 / 2.60, F.linear 1.71 / 1.73 / 1.99 / 2.12 / 3.05.
# Its own bounds would be int8 GEMV 8, int8 pack 12, int4 native 6, bf16 panel 32; at 8-16 rows
# the kernels it would trade are within 10% of each other there, inside that VM's spread between
# runs, so this row serves Zen 4 too (docs/performance.md, 2026-11-27).
# W4A8 rows against panel (Zen 4 again, 2026-11-27, 2 threads, 4 copies of a 5632 x 2048 weight
# cycled, medians of 7 interleaved; ms at 1 / 2 / 3 / 4 rows): groups of 32 0.34 / 0.44 / 0.56 /
# 0.67 against 0.55 / 0.57 / 0.61 / 0.65, groups of 128 0.24 / 0.36 / 0.46 / 0.56 against 0.41 /
# 0.45 / 0.48 / 0.50: a8_rows_max_rows 3 (the avx512 tier runs the same code).
ZEN5_AVX512 = Crossovers(int8_gemv_max_rows=24, int8_pack_max_rows=24, int4_native_max_rows=8,
                         int4_pack_max_rows=32, bf16_gemv_max_rows=4, int4_gemm_max_rows=512,
                         int8_gemm_max_rows=512, bf16_gemm_max_rows=16, a8_rows_max_rows=3)
# avx512 (no BF16): the first run's bounds; the panel kernel (bf16 dot products emulated there)
# not measured
ZEN5_AVX512_NO_BF16 = Crossovers(int8_gemv_max_rows=24, int8_pack_max_rows=16,
                                 int4_native_max_rows=16, int4_pack_max_rows=32,
                                 bf16_gemv_max_rows=4,
                                 int4_gemm_max_rows=ZEN5_AVX512.int4_gemm_max_rows,  # inherited
                                 int8_gemm_max_rows=ZEN5_AVX512.int8_gemm_max_rows,  # inherited
                                 bf16_gemm_max_rows=ZEN5_AVX512.bf16_gemm_max_rows,  # inherited
                                 a8_rows_max_rows=ZEN5_AVX512.a8_rows_max_rows)  # the same code

# avx2, 2026-11-25, the same Zen 5 quiet (load 0.5-1.4), 2 threads, torch AND oneDNN capped to
# AVX2 (ONEDNN_MAX_CPU_ISA=AVX2: before, the lower tiers' F.linear ran oneDNN's AVX-512 GEMMs),
# with the AVX2 bf16 panel blocks of csrc/cpu_qgemm.c, medians of 5 (`python
# benchmarks/crossovers.py --tiers avx2 --reps 5 --rows 1 2 4 8 16 24 32 64 128 256 512`), ms at
# 1 / 4 / 16 / 64 / 128 / 256 / 512 rows: F.linear 0.54 / 1.70 / 7.06 / 26.4 / 50.9 / 102 / 204,
# bf16 panel 0.88 / 1.21 / 2.55 / 7.84 / 15.1 / 29.5 / 57.7; int8 GEMV 0.30 / 0.81 / 2.81 / 10.8 /
# 21.6 / 42.7 / 85.8, int8 panel 9.49 / 9.59 / 10.9 / 16.2 / 23.4 / 37.7 / 68.6,
# _weight_int8pack_mm 1.15 / 1.51 / 3.71 / 11.6 / 21.8 / 41.4 / 80.5, dequantize + GEMM 8.97 /
# 10.5 / 16.4 / 36.2 / 62.2 / 115 / 218; int4 native 0.28 / 0.88 / 2.94 / 11.3 / 24.1 / 49.5 /
# 102, int4 panel 8.62 / 8.85 / 10.2 / 15.5 / 22.7 / 36.9 / 65.9, _weight_int4pack_mm_for_cpu
# 0.61 / 0.70 / 2.60 / 10.1 / 20.3 / 40.3 / 81.0, dequantize + GEMM 52.4 / 51.5 / 57.1 / 76.5 /
# 103 / 157 / 261. The bf16 GEMV (ad-hoc, the same caps, medians of 41) 0.51 / 0.59 / 0.61 /
# 0.74 ms at 1-4 rows against F.linear's 0.46 / 0.86 / 1.37 / 1.72: it keeps 1-4 rows (0.91x
# at one row, where the model's own one-row linears run in the native decode layer anyway).
# W4A8 rows against panel at avx2 (Zen 4 capped, as the avx512 row above; ms at 1 / 8 / 12 / 16
# / 24 rows): groups of 32 0.49 / 1.68 / 2.34 / 3.02 / 4.36 against 2.62 / 3.12 / 3.42 / 3.74 /
# 4.37, groups of 128 0.52 / 1.87 / 2.64 / 3.39 / 4.93 against 2.18 / 2.63 / 2.91 / 3.17 / 3.71:
# a8_rows_max_rows 12.
ZEN5_AVX2 = Crossovers(int8_gemv_max_rows=128, int8_pack_max_rows=512, int4_native_max_rows=64,
                       int4_pack_max_rows=512, bf16_gemv_max_rows=4, int4_gemm_max_rows=512,
                       int8_gemm_max_rows=512, bf16_gemm_max_rows=512, a8_rows_max_rows=12)
# avx2 again on the 2-core Zen 4 (capped as above), 2026-11-28, after the chunked dequantize +
# GEMM of many bf16 rows became fp32 GEMMs at this tier (kernels/linear.py: bf16_gemm_in_fp32),
# which moved the bounds the other paths meet it at. Four runs (`python benchmarks/crossovers.py
# --tiers avx2 --reps 7 --copies 4 --rows 1 4 8 16 32 64 96 128 192 256 384 512`, the first two
# before the bf16 comparison took the fp32 GEMMs too), their crossovers: int8 GEMV 128 / 96 /
# 192 / 64, int8 panel 0 in all four (dequantize + fp32 GEMMs 73.7-80.3 ms at 512 rows against
# the panel's 83.2-90.2), int8 pack 128 / 96 / 128 / 96, int4 native 96 / 96 / 128 / 128, int4
# panel 384 / 512 / 512 / 512, int4 pack 256 / 192 / 256 / 256, bf16 panel against the fp32
# GEMMs 128 / 192 (ms at 128 / 256 / 512 rows: 19.9 / 40.3 / 77.3 against 21.6 / 38.3 / 71.5).
# Taken: int8 GEMV 128 (the panel after it never: its bound is the GEMV's), int8 pack 128,
# int4 native 96, int4 panel 512, int4 pack 256, bf16 panel 128; the bf16 GEMV and W4A8 rows
# stay the Zen 5's.
ZEN4_AVX2 = dataclasses.replace(ZEN5_AVX2, int8_gemv_max_rows=128, int8_gemm_max_rows=128,
                                int8_pack_max_rows=128, int4_native_max_rows=96,
                                int4_gemm_max_rows=512, int4_pack_max_rows=256,
                                bf16_gemm_max_rows=128)

# avx2_vnni (the avx2 loops with AVX-VNNI's vpdpbusd / vpdpwssd, csrc/hfd_avx2.h), 2026-11-25,
# the same Zen 5, method and caps (ONEDNN_MAX_CPU_ISA=AVX2_VNNI), quiet (load ~1), medians of 5
# (`python benchmarks/crossovers.py --tiers avx2_vnni --reps 5 --rows 1 4 16 64 128 192 256 384
# 512`), ms at 1 / 16 / 64 / 128 / 192 / 256 / 512 rows: int8 GEMV 0.28 / 2.13 / 7.73 / 15.8 /
# 23.5 / 31.6 / 62.5 against the int8 panel 9.11 / 10.6 / 15.9 / 22.6 / 29.8 / 36.4 / 65.5 (the
# GEMV wins at every row count measured: int8_gemm_max_rows = the GEMV's, the panel never
# runs); int4 native 0.28 / 2.50 / 9.22 / 19.1 / 30.3 / 40.8 / 84.0 against the int4 panel 8.33 /
# 10.0 / 15.2 / 22.2 / 29.0 / 35.9 / 66.5; bf16 panel and F.linear as at avx2 (0.85 / 2.53 /
# 7.67 / 14.5 / 21.4 / 28.2 / 60.9 against 0.53 / 6.95 / 25.1 / 49.8 / 74.3 / 100 / 199).
ZEN5_AVX2_VNNI = Crossovers(int8_gemv_max_rows=512, int8_pack_max_rows=512,
                            int4_native_max_rows=128, int4_pack_max_rows=512,
                            bf16_gemv_max_rows=4, int4_gemm_max_rows=512, int8_gemm_max_rows=512,
                            bf16_gemm_max_rows=512,
                            a8_rows_max_rows=ZEN5_AVX2.a8_rows_max_rows)  # inherited

TABLE: dict[str, Crossovers] = {
    # measured on the Xeon (bf16_gemv_max_rows None: not measured there; a8_rows_max_rows: the
    # default 1, not measured there)
    "amx": XEON,
    "avx512_bf16": ZEN5_AVX512,
    "avx512": ZEN5_AVX512_NO_BF16,
    "avx2_vnni": ZEN5_AVX2_VNNI,
    "avx2": ZEN4_AVX2,
    "generic": Crossovers(int8_gemv_max_rows=ZEN5_AVX2.int8_gemv_max_rows,  # inherited
                          int8_pack_max_rows=1, int4_native_max_rows=1, int4_pack_max_rows=1,
                          bf16_gemv_max_rows=ZEN5_AVX512.bf16_gemv_max_rows,  # inherited
                          int4_gemm_max_rows=ZEN5_AVX512.int4_gemm_max_rows,  # inherited
                          int8_gemm_max_rows=ZEN5_AVX512.int8_gemm_max_rows,  # inherited
                          bf16_gemm_max_rows=ZEN5_AVX512.bf16_gemm_max_rows,  # inherited
                          a8_rows_max_rows=ZEN5_AVX2.a8_rows_max_rows),  # inherited
}
assert set(TABLE) == set(_native.TIERS)


def rows(tier: str | None = None) -> Crossovers:
    """The crossovers of `tier` (default: the tier the native kernels run here)."""
    return TABLE[tier or _native.tier()]
