/* Vector helpers shared by the native CPU kernels (cpu_quant.c, cpu_moe.c, cpu_decode.c), which
 * _native.py compiles together into one library per ISA tier (see _native.py's TIERS).
 *
 * The kernels are written with AVX-512 intrinsics (16 fp32 lanes). SIMDe (simde-py) maps each
 * intrinsic to the instruction where the build's target has it, and otherwise to an emulation
 * on the target's own vectors (two AVX2 registers, NEON, or plain C): vpdpbusd's exact integer
 * sums, vdpbf16ps' pair products, masked loads and stores. Every lane computes the same IEEE
 * operations in every tier, and the horizontal sums below use the order of gcc's AVX-512
 * reductions, so a kernel returns the same bits on every tier (tests/kernels/test_native_tiers.py
 * checks it, and tests/kernels/test_native_arm64.py for aarch64, where SIMDe maps the intrinsics
 * to NEON). A fused multiply-add rounds once everywhere: the FMA instruction on x86 from avx2 up
 * and NEON's on aarch64, libm's fmaf on baseline x86-64 (below: SIMDe's emulation there is a
 * product and a sum, two roundings). _native.py builds with -ffp-contract=off, so gcc never
 * fuses a product and a sum that the source keeps apart, whatever FMA unit the target has.
 * The one documented difference: vdpbf16ps flushes denormals, its emulation does not (below).
 * The int8, int4 and bf16 dot products, where the emulation was the bottleneck, have loops of
 * their own on the avx2 tier (hfd_avx2.h): 256-bit instructions, the same integer sums and the same
 * fp32 operations per lane, so the same bits.
 * AMX tile code is compiled only into the amx tier; elsewhere the tile intrinsics trap, and
 * amx_usable() (cpu_moe.c) is 0 there, so they are never reached.
 *
 * Rounding follows torch: fp32 -> bf16 / fp16 round to nearest even, NaN kept quiet, so a kernel
 * that rounds where a torch op would round reproduces it bit for bit. */
#ifndef HFD_SIMD_H
#define HFD_SIMD_H

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* AVX-VNNI's two ymm instructions (the avx2_vnni tier). HFD_EMULATE_AVX_VNNI, for the tests
   only (tests/kernels/test_native_vnni_emulated.py), builds the avx2 tier with the avx2_vnni
   tier's loops and exact AVX2 emulations of the two instructions, so those loops run on a CPU
   without AVX-VNNI: the same int32 lane sums (u8 x s8 and s16 x s16 products are exact in
   vpmaddwd's int32 pair sums; the lane sums wrap as the instructions' do). */
#if defined(__AVXVNNI__)
#define HFD_VNNI_INSNS 1
#elif defined(HFD_EMULATE_AVX_VNNI) && defined(__AVX2__) && !defined(__AVX512F__)
#define HFD_VNNI_INSNS 1
#include <immintrin.h>
/* acc + per dword the 4 products of a's unsigned bytes and b's signed bytes */
static inline __m256i hfd_emulated_dpbusd(__m256i acc, __m256i a, __m256i b) {
    const __m256i low = _mm256_set1_epi16(0x00FF);
    const __m256i ae = _mm256_and_si256(a, low), ao = _mm256_srli_epi16(a, 8);
    const __m256i be = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8), bo = _mm256_srai_epi16(b, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(ae, be),
                                                  _mm256_madd_epi16(ao, bo)));
}
/* acc + per dword the 2 products of signed words */
static inline __m256i hfd_emulated_dpwssd(__m256i acc, __m256i a, __m256i b) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}
#undef _mm256_dpbusd_avx_epi32
#undef _mm256_dpwssd_avx_epi32
#define _mm256_dpbusd_avx_epi32 hfd_emulated_dpbusd
#define _mm256_dpwssd_avx_epi32 hfd_emulated_dpwssd
#else
#define HFD_VNNI_INSNS 0
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
#define HFD_AMX 1
#include <immintrin.h>
#else
#define HFD_AMX 0
#undef _tile_loadconfig
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_release
#undef _tile_dpbf16ps
#undef _tile_dpbusd
#define _tile_loadconfig(cfg) __builtin_trap()
#define _tile_loadd(t, p, s) __builtin_trap()
#define _tile_stored(t, p, s) __builtin_trap()
#define _tile_zero(t) __builtin_trap()
#define _tile_release() __builtin_trap()
#define _tile_dpbf16ps(c, a, b) __builtin_trap()
#define _tile_dpbusd(c, a, b) __builtin_trap()
#endif

#if !defined(__AVX512F__)
/* The horizontal sums SIMDe lacks, in gcc's order for _mm512_reduce_*: lanes i and i + 8, then
   i and i + 4, then i and i + 2, then the last pair. */
static inline float hfd_reduce_add_ps(__m512 v) {
    float a[16], b[8];
    memcpy(a, &v, sizeof(a));
    for (int i = 0; i < 8; i++) b[i] = a[i + 8] + a[i];
    for (int i = 0; i < 4; i++) b[i] = b[i + 4] + b[i];
    for (int i = 0; i < 2; i++) b[i] = b[i] + b[i + 2];
    return b[0] + b[1];
}
static inline int hfd_reduce_add_epi32(__m512i v) {
    int32_t a[16];
    memcpy(a, &v, sizeof(a));
    uint32_t s = 0; /* integer sums: any order gives the same (wrapping) result */
    for (int i = 0; i < 16; i++) s += (uint32_t)a[i];
    return (int)s;
}
#define _mm512_reduce_add_ps(v) hfd_reduce_add_ps(v)
#define _mm512_reduce_add_epi32(v) hfd_reduce_add_epi32(v)

/* Conversions, masked loads and a gather that SIMDe 0.8 does not emulate: lane by lane, with
   the instructions' semantics (truncating narrowing, zeroed masked lanes). */
#define HFD_LANEWISE(name, ret_t, arg_t, out_e, in_e, n, expr)                                  \
    static inline ret_t name(arg_t v) {                                                         \
        in_e a[n];                                                                              \
        out_e r[n];                                                                             \
        ret_t o;                                                                                \
        memcpy(a, &v, sizeof(a));                                                               \
        for (int i = 0; i < n; i++) r[i] = (out_e)(expr);                                       \
        memcpy(&o, r, sizeof(r));                                                               \
        return o;                                                                               \
    }
#if defined(__AVX2__)
/* The widening and narrowing of the dequantization and rounding loops, in AVX2 instructions
   (the lane-by-lane versions below compile to scalar moves through the stack there). */
#define HFD_WIDEN8(name, widen)                                                                 \
    static inline simde__m512i name(simde__m128i v) {                                           \
        __m128i b;                                                                              \
        __m256i r[2];                                                                           \
        simde__m512i o;                                                                         \
        memcpy(&b, &v, 16);                                                                     \
        r[0] = widen(b);                                                                        \
        r[1] = widen(_mm_srli_si128(b, 8));                                                     \
        memcpy(&o, r, 64);                                                                      \
        return o;                                                                               \
    }
HFD_WIDEN8(hfd_cvtepu8_epi32, _mm256_cvtepu8_epi32)
HFD_WIDEN8(hfd_cvtepi8_epi32, _mm256_cvtepi8_epi32)
/* the low 16 bits of each int32, in order (vpackusdw works per 128-bit lane: 0xD8 reorders) */
static inline __m256i hfd_low16(simde__m512i v) {
    __m256i h[2];
    memcpy(h, &v, 64);
    const __m256i m = _mm256_set1_epi32(0xFFFF);
    return _mm256_permute4x64_epi64(
        _mm256_packus_epi32(_mm256_and_si256(h[0], m), _mm256_and_si256(h[1], m)), 0xD8);
}
static inline simde__m256i hfd_cvtepi32_epi16(simde__m512i v) {
    __m256i r = hfd_low16(v);
    simde__m256i o;
    memcpy(&o, &r, 32);
    return o;
}
static inline simde__m128i hfd_cvtepi32_epi8(simde__m512i v) {
    __m256i w = _mm256_and_si256(hfd_low16(v), _mm256_set1_epi16(0xFF));
    __m128i r = _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    simde__m128i o;
    memcpy(&o, &r, 16);
    return o;
}
#else
HFD_LANEWISE(hfd_cvtepi32_epi16, simde__m256i, simde__m512i, int16_t, int32_t, 16, a[i])
HFD_LANEWISE(hfd_cvtepi32_epi8, simde__m128i, simde__m512i, int8_t, int32_t, 16, a[i])
HFD_LANEWISE(hfd_cvtepi8_epi32, simde__m512i, simde__m128i, int32_t, int8_t, 16, a[i])
HFD_LANEWISE(hfd_cvtepu8_epi32, simde__m512i, simde__m128i, int32_t, uint8_t, 16, a[i])
#endif
HFD_LANEWISE(hfd_cvtepi32_pd, simde__m512d, simde__m256i, double, int32_t, 8, a[i])
HFD_LANEWISE(hfd_cvtpd_ps, simde__m256, simde__m512d, float, double, 8, a[i])
#define _mm512_cvtepi32_epi16(v) hfd_cvtepi32_epi16(v)
#define _mm512_cvtepi32_epi8(v) hfd_cvtepi32_epi8(v)
#define _mm512_cvtepi8_epi32(v) hfd_cvtepi8_epi32(v)
#define _mm512_cvtepu8_epi32(v) hfd_cvtepu8_epi32(v)
#define _mm512_cvtepi32_pd(v) hfd_cvtepi32_pd(v)
#define _mm512_cvtpd_ps(v) hfd_cvtpd_ps(v) /* round to nearest even, as the default MXCSR */

static inline simde__m256i hfd_cvtps_ph(simde__m512 v) {
    simde__m256i o;
    simde__m128i lo = simde_mm256_cvtps_ph(simde_mm512_extractf32x8_ps(v, 0), 0);
    simde__m128i hi = simde_mm256_cvtps_ph(simde_mm512_extractf32x8_ps(v, 1), 0);
    memcpy(&o, &lo, 16);
    memcpy((char *)&o + 16, &hi, 16);
    return o;
}
#define _mm512_cvtps_ph(v, r) hfd_cvtps_ph(v)

/* Masked loads and stores touch only the lanes the mask selects, as the instructions do (a
   masked load at the end of a buffer must not read past it, a masked store must leave the other
   bytes alone: SIMDe 0.8 reads whole vectors there and stores zeros, so these replace it). */
#define HFD_MASKED(name, lanes, elem_t, vec_t)                                                  \
    static inline vec_t hfd_maskz_load_##name(uint64_t k, const void *p) {                      \
        vec_t o;                                                                                \
        if (lanes == 64 ? k == ~(uint64_t)0 : k == (((uint64_t)1 << (lanes & 63)) - 1)) {       \
            memcpy(&o, p, sizeof(o));                                                           \
            return o;                                                                           \
        }                                                                                       \
        elem_t r[lanes];                                                                        \
        for (int i = 0; i < lanes; i++) r[i] = (k >> i) & 1 ? ((const elem_t *)p)[i] : 0;      \
        memcpy(&o, r, sizeof(o));                                                               \
        return o;                                                                               \
    }                                                                                           \
    static inline void hfd_mask_store_##name(void *p, uint64_t k, vec_t v) {                    \
        elem_t r[lanes];                                                                        \
        memcpy(r, &v, sizeof(r));                                                               \
        for (int i = 0; i < lanes; i++)                                                         \
            if ((k >> i) & 1) ((elem_t *)p)[i] = r[i];                                          \
    }
HFD_MASKED(ps512, 16, float, simde__m512)
HFD_MASKED(epi32_512, 16, int32_t, simde__m512i)
HFD_MASKED(epi16_512, 32, uint16_t, simde__m512i)
HFD_MASKED(epi16_256, 16, uint16_t, simde__m256i)
HFD_MASKED(epi8_512, 64, uint8_t, simde__m512i)
HFD_MASKED(epi8_128, 16, uint8_t, simde__m128i)
#undef _mm512_maskz_loadu_ps
#undef _mm512_mask_storeu_ps
#undef _mm512_maskz_loadu_epi16
#undef _mm256_maskz_loadu_epi16
#undef _mm256_mask_storeu_epi16
#define _mm512_maskz_loadu_ps(k, p) hfd_maskz_load_ps512(k, p)
#define _mm512_mask_storeu_ps(p, k, v) hfd_mask_store_ps512(p, k, v)
#define _mm512_maskz_loadu_epi32(k, p) hfd_maskz_load_epi32_512(k, p)
#define _mm512_maskz_loadu_epi16(k, p) hfd_maskz_load_epi16_512(k, p)
#define _mm256_maskz_loadu_epi16(k, p) hfd_maskz_load_epi16_256(k, p)
#define _mm256_mask_storeu_epi16(p, k, v) hfd_mask_store_epi16_256(p, k, v)
#define _mm512_maskz_loadu_epi8(k, p) hfd_maskz_load_epi8_512(k, p)
#define _mm_maskz_loadu_epi8(k, p) hfd_maskz_load_epi8_128(k, p)
/* lanes of src where k is clear, else the int32 at base + idx * scale */
static inline simde__m512i hfd_mask_i32gather_epi32(simde__m512i src, uint16_t k, simde__m512i idx,
                                                    const void *base, int scale) {
    int32_t r[16], ix[16];
    memcpy(r, &src, 64);
    memcpy(ix, &idx, 64);
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) memcpy(&r[i], (const char *)base + (int64_t)ix[i] * scale, 4);
    simde__m512i o;
    memcpy(&o, r, 64);
    return o;
}
#define _mm512_mask_i32gather_epi32(s, k, i, b, sc) hfd_mask_i32gather_epi32(s, k, i, b, sc)
#ifndef _MM_FROUND_NO_EXC
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#endif
#endif

#if !defined(__FMA__) && !defined(__ARM_FEATURE_FMA)
/* No FMA unit (baseline x86-64): SIMDe would compute a * b + c with two roundings, where every
   other target rounds once; fmaf per lane gives the one-rounding result (slowly: this target is
   the last resort of CPUs older than AVX2). */
#define HFD_FMA_LANES(name, neg)                                                                \
    static inline simde__m512 name(simde__m512 a, simde__m512 b, simde__m512 c) {              \
        float x[16], y[16], z[16];                                                              \
        memcpy(x, &a, 64);                                                                      \
        memcpy(y, &b, 64);                                                                      \
        memcpy(z, &c, 64);                                                                      \
        for (int i = 0; i < 16; i++) z[i] = fmaf(neg x[i], y[i], z[i]);                        \
        memcpy(&c, z, 64);                                                                      \
        return c;                                                                               \
    }
HFD_FMA_LANES(hfd_fmadd_ps, +)
HFD_FMA_LANES(hfd_fnmadd_ps, -)
#undef _mm512_fmadd_ps
#undef _mm512_fnmadd_ps
#define _mm512_fmadd_ps(a, b, c) hfd_fmadd_ps(a, b, c)
#define _mm512_fnmadd_ps(a, b, c) hfd_fnmadd_ps(a, b, c)
#endif

#if !defined(__AVX512VNNI__)
/* vpdpbusd: acc + the sums of 4 adjacent u8 x s8 products, exact (int32 lanes). With AVX-VNNI
   the 256-bit instruction; on AVX2 the u8
   side is split into nibbles so vpmaddubsw's int16 pair sums (at most 2 * 15 * 128) never
   saturate; the integer sums are the instruction's to the bit. */
static inline simde__m512i hfd_dpbusd_epi32(simde__m512i acc, simde__m512i a, simde__m512i b) {
#if HFD_VNNI_INSNS /* the 256-bit instruction on each half (the avx2_vnni tier) */
    __m256i c[2], x[2], w[2];
    memcpy(c, &acc, 64);
    memcpy(x, &a, 64);
    memcpy(w, &b, 64);
    for (int h = 0; h < 2; h++) c[h] = _mm256_dpbusd_avx_epi32(c[h], x[h], w[h]);
    memcpy(&acc, c, 64);
    return acc;
#elif defined(__AVX2__)
    __m256i c[2], x[2], w[2];
    memcpy(c, &acc, 64);
    memcpy(x, &a, 64);
    memcpy(w, &b, 64);
    const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) {
        __m256i lo = _mm256_maddubs_epi16(_mm256_and_si256(x[h], nib), w[h]);
        __m256i hi = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(x[h], 4), nib), w[h]);
        c[h] = _mm256_add_epi32(c[h], _mm256_add_epi32(_mm256_madd_epi16(lo, ones),
                                                       _mm256_slli_epi32(_mm256_madd_epi16(hi, ones), 4)));
    }
    memcpy(&acc, c, 64);
    return acc;
#else
    int32_t s[16];
    uint8_t x[64];
    int8_t w[64];
    memcpy(s, &acc, 64);
    memcpy(x, &a, 64);
    memcpy(w, &b, 64);
    for (int i = 0; i < 16; i++)
        s[i] += x[4 * i] * w[4 * i] + x[4 * i + 1] * w[4 * i + 1] + x[4 * i + 2] * w[4 * i + 2]
              + x[4 * i + 3] * w[4 * i + 3];
    memcpy(&acc, s, 64);
    return acc;
#endif
}
#undef _mm512_dpbusd_epi32
#define _mm512_dpbusd_epi32(c, a, b) hfd_dpbusd_epi32(c, a, b)
#endif

#if !defined(__AVX512BF16__)
/* vdpbf16ps: acc + a_odd * b_odd, then + a_even * b_even, each rounded once (a bf16 product is
   exact in fp32, so an FMA or a product and a sum give the same bits). The instruction also
   flushes denormal inputs and results to zero, which this does not: values below 1.2e-38, never
   met in weights and activations, are where the tiers may differ. */
static inline simde__m512 hfd_dpbf16_ps(simde__m512 acc, simde__m512bh a, simde__m512bh b) {
    simde__m512i ai, bi;
    memcpy(&ai, &a, 64);
    memcpy(&bi, &b, 64);
    const simde__m512i hi = simde_mm512_set1_epi32((int)0xFFFF0000u);
    acc = _mm512_fmadd_ps(simde_mm512_castsi512_ps(simde_mm512_and_si512(ai, hi)),
                               simde_mm512_castsi512_ps(simde_mm512_and_si512(bi, hi)), acc);
    return _mm512_fmadd_ps(simde_mm512_castsi512_ps(simde_mm512_slli_epi32(ai, 16)),
                                simde_mm512_castsi512_ps(simde_mm512_slli_epi32(bi, 16)), acc);
}
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps(c, a, b) hfd_dpbf16_ps(c, a, b)
#endif

#if !defined(__F16C__)
/* fp16 <-> fp32 scalars (round to nearest even), where the target has no F16C */
static inline float hfd_cvtsh_ss(uint16_t h) {
    return simde_mm_cvtss_f32(simde_mm_cvtph_ps(simde_mm_set1_epi16((short)h)));
}
static inline uint16_t hfd_cvtss_sh(float f) {
    return (uint16_t)simde_mm_extract_epi16(simde_mm_cvtps_ph(simde_mm_set1_ps(f), 0), 0);
}
#define _cvtsh_ss(h) hfd_cvtsh_ss(h)
#define _cvtss_sh(f, r) hfd_cvtss_sh(f)
#endif

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

/* Bytes ahead of the current column that streamed bf16 weight rows (4 KiB and up) are
   prefetched. Measured when the int8 rows used it: from DRAM (weights cycled past the L3) a
   5632 x 2048 int8 matrix streamed at 14.6 GB/s without, 17.3 GB/s with 1024 (512: 16.0, 2048:
   15.5), 19.1 GB/s with 1024 and transparent huge pages. Shorter rows (int8, int4) prefetch
   the next block instead: prefetch_next_block. */
#define PREFETCH 1024

/* Rows of 1-3 KiB are too short for a prefetch ahead within each row; a kernel streaming a
   block of contiguous rows prefetches the block it reads next (from next, NULL: none, up to
   end) instead, `lines` cache lines from line `first` on, at the pace it reads its own.
   always_inline: gcc counts a prefetch as no side effect, so where it kept this out of line
   (in cpu_decode.c's lin_block) it deleted the calls, and the int4 / int8 rows ran unfetched.
   l2 (a literal): into L2 only (_MM_HINT_T2) instead of L1, for a block much larger than the
   rows a kernel has in flight (cpu_decode.c: a8_dots_g says where and what it measured). */
static inline __attribute__((always_inline)) void prefetch_next_block(const void *next, const void *end, int64_t first,
                                       int lines, int l2) {
    if (!next) return;
    for (int i = 0; i < lines; i++) {
        const char *p = (const char *)next + 64 * (first + i);
        if (p >= (const char *)end) continue;
        if (l2)
            _mm_prefetch(p, _MM_HINT_T2);
        else
            _mm_prefetch(p, _MM_HINT_T0);
    }
}

/* Row tiles: a weight of N rows of B bytes each (N % TILE_ROWS == 0, B % 64 == 0) may be stored
   as [N / TILE_ROWS, B / 64, TILE_ROWS, 64] bytes (kernels/quant.py stores int8 weights and 4-bit
   codes so on CPU), so the TILE_ROWS rows a thread streams together are one sequential stream:
   64 bytes of each row in turn. Byte b of row r is then at tile_row(q, r, B, 1) + tile_at(b, 1). */
#define TILE_ROWS 4

static inline const uint8_t *tile_row(const void *q, int64_t r, int64_t row_bytes, int tiled) {
    const uint8_t *base = (const uint8_t *)q;
    return tiled ? base + (r / TILE_ROWS) * TILE_ROWS * row_bytes + (r % TILE_ROWS) * 64
                 : base + r * row_bytes;
}

static inline int64_t tile_at(int64_t b, int tiled) {
    return tiled ? (b & ~(int64_t)63) * TILE_ROWS + (b & 63) : b;
}

/* 4-bit codes in tiles also take a column order of their own within each row (quant.py's
   int4_super_order): a row's codes are packed two per byte, column 2o in the low nibble of byte
   o, and each whole 256-byte run of a row (512 columns, a "super-chunk") is stored with its
   bytes as [4][16][4] instead of [16][4][4]: stored byte 64i + 4j + b holds row byte
   16j + 4i + b. A 64-byte load i then gives dword lane j the 8 columns 512s + 32j + 8i + ...,
   so across the super-chunk's 4 loads each lane keeps to one 32-column run, inside one group
   (groups are 32-256 columns): cpu_decode.c's int4 kernel sums a lane's 32 products in
   integers and scales once per super-chunk, not once per load. Bytes past the last whole
   super-chunk keep their order. int4_order: where row byte o is stored (before tiling). */
#define INT4_SUPER 256

static inline int64_t int4_order(int64_t o, int64_t row_bytes) {
    if (o >= row_bytes / INT4_SUPER * INT4_SUPER) return o;
    const int64_t w = o & (INT4_SUPER - 1);
    return (o - w) + ((w >> 2) & 3) * 64 + (w >> 4) * 4 + (w & 3);
}

/* Bytes ahead of the current position that a thread streaming tiles prefetches. 22 Llama-1.1B
   MLPs from DRAM, 2 threads, int8, 3 interleaved runs: row-major rows with the next block
   prefetched 21.7-22.2 GB/s; tiles with 0 / 512 / 1024 / 2048 / 3072 / 4096 bytes ahead
   23.3-24.3 / 24.3-25.5 / 25.5-25.8 / 26.5-27.4 / 26.2-26.7 / 24.6-25.0 GB/s (bf16 rows:
   28.0-28.5). In the model (Llama-1.1B decode step, 4 interleaved runs): int4 1024 / 2048 /
   3072 / 4096: 35.3 / 33.4 / 33.5 / 34.0 ms; int8 flat at 45-46 ms from 1280 to 2048, 57 ms at
   3072. */
#define TILE_PREFETCH 2048

/* Prefetch the TILE_ROWS lines of a tile stream TILE_PREFETCH bytes past `at`, short of end. */
static inline __attribute__((always_inline)) void prefetch_tiles(const void *at, const void *end) {
    for (int r = 0; r < TILE_ROWS; r++) {
        const char *p = (const char *)at + TILE_PREFETCH + 64 * r;
        if (p < (const char *)end) _mm_prefetch(p, _MM_HINT_T0);
    }
}

/* r[i] (16 dwords each) -> r[j] holding dword j of every input row: a 16 x 16 transpose */
static inline void transpose16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* r[4q + p] now holds dwords 4c + p' of rows 4q..4q+3 per 128-bit lane c; gather lanes */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

static inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

static inline float load_f32(const void *p, int64_t i, int dt) {
    if (dt == DT_F32) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    if (dt == DT_BF16) {
        uint32_t u = (uint32_t)h << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    return _cvtsh_ss(h);
}

/* 16 elements of x from element i on (masked lanes read as 0), as fp32 */
static inline __m512 load16(const void *p, int64_t i, int dt, __mmask16 mk) {
    if (dt == DT_F32) return _mm512_maskz_loadu_ps(mk, (const float *)p + i);
    __m256i h = _mm256_maskz_loadu_epi16(mk, (const uint16_t *)p + i);
    if (dt == DT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

static inline __mmask16 mask16(int64_t left) {
    return (__mmask16)(left >= 16 ? 0xFFFF : left > 0 ? (1u << left) - 1 : 0);
}

/* Round to nearest even, as torch's float -> bf16 / fp16 conversions do. */
static inline void store_f32(void *p, int64_t i, int dt, float v) {
    if (dt == DT_F32) {
        ((float *)p)[i] = v;
    } else if (dt == DT_BF16) {
        uint32_t u;
        memcpy(&u, &v, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            ((uint16_t *)p)[i] = (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
            return;
        }
        u += 0x7fffu + ((u >> 16) & 1u);
        ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
    } else {
        ((uint16_t *)p)[i] = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
    }
}

/* ---- 16 fp32 lanes ---- */

/* fp32 -> bf16 bits (round to nearest even, NaN kept quiet) in the low 16 bits of each lane:
   torch's float -> bfloat16 conversion, lane-wise (not vcvtneps2bf16, which flushes
   denormals). */
#if defined(__AVX2__) && !defined(__AVX512F__)
/* The avx2 tiers: the same integer operations on two 256-bit halves (SIMDe's emulation of the
   mask compare and move was ~4% of an int4 decode step there) */
static inline __m256i hfd_bf16_bits8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)),
                              nan);
}

static inline __m512i bf16_bits(__m512 v) {
    __m256 h[2];
    __m256i r[2];
    __m512i out;
    memcpy(h, &v, 64);
    r[0] = hfd_bf16_bits8(h[0]);
    r[1] = hfd_bf16_bits8(h[1]);
    memcpy(&out, r, 64);
    return out;
}
#else
static inline __m512i bf16_bits(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
}
#endif

static inline __m512 bf16_round(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}

/* bf16_bits / bf16_round for values arithmetic computed (tile sums, quotients, products): the same
   round to nearest even, without bf16_bits' quieting of signalling NaNs, which arithmetic never
   produces (a quiet NaN rounds to the same 0x7fc0 / 0xffc0 either way); 5 ops instead of 8, for
   epilogues bound by their op count (cpu_moe.c's AMX epilogues). */
static inline __m512i bf16_bits_q(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
}

static inline __m512 bf16_round_q(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits_q(v), 16));
}

static inline void store16_bf16(uint16_t *p, __mmask16 mk, __m512 v) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    __m256 h[2];
    memcpy(h, &v, 64);
    const __m256i r0 = hfd_bf16_bits8(h[0]), r1 = hfd_bf16_bits8(h[1]);
    /* the 16 results (each < 2^16) in order: vpackusdw packs per 128-bit lane */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r0, r1), 0xD8);
    if (mk == 0xFFFF) {
        _mm256_storeu_si256((__m256i *)p, packed);
    } else {
        uint16_t t[16];
        _mm256_storeu_si256((__m256i *)t, packed);
        for (int i = 0; i < 16; i++)
            if (mk >> i & 1) p[i] = t[i];
    }
#else
    _mm256_mask_storeu_epi16(p, mk, _mm512_cvtepi32_epi16(bf16_bits(v)));
#endif
}

/* exp_ps's steps after the clamp, written once for 256- and 512-bit vectors (W: _mm256 or
   _mm512, V: its float vector type): r = x - n ln 2 (Cody-Waite, ln 2 in two parts), then
   p = e^r by the degree-6 polynomial on [-ln2/2, ln2/2]. */
#define HFD_EXP_POLY(W, V, x, n, p)                                                             \
    do {                                                                                        \
        V r_ = W##_fnmadd_ps(n, W##_set1_ps(0.693359375f), x);                                  \
        r_ = W##_fnmadd_ps(n, W##_set1_ps(-2.12194440e-4f), r_);                                \
        p = W##_set1_ps(1.9875691500e-4f);                                                      \
        p = W##_fmadd_ps(p, r_, W##_set1_ps(1.3981999507e-3f));                                 \
        p = W##_fmadd_ps(p, r_, W##_set1_ps(8.3334519073e-3f));                                 \
        p = W##_fmadd_ps(p, r_, W##_set1_ps(4.1665795894e-2f));                                 \
        p = W##_fmadd_ps(p, r_, W##_set1_ps(1.6666665459e-1f));                                 \
        p = W##_fmadd_ps(p, r_, W##_set1_ps(5.0000001201e-1f));                                 \
        p = W##_fmadd_ps(p, W##_mul_ps(r_, r_), W##_add_ps(r_, W##_set1_ps(1.0f)));             \
    } while (0)

/* y = scalef(p, n) = p * 2^n for n an integer in [-150, 128] (exp_ps's range), below AVX-512
   (SIMDe computed scalef with a scalar exp2f per lane, and gave inf, not the instruction's
   finite value, for n = 128): (p * 2^(n >> 1)) * 2^(n - (n >> 1)), both factors normal powers
   of two, the first product exact and normal, the second the one rounding scalef does,
   subnormal results included. VI: the int vector type, SI: si256 or si512. */
#define HFD_EXP_SCALE(W, VI, SI, p, n, y)                                                       \
    do {                                                                                        \
        const VI ni_ = W##_cvtps_epi32(n), bias_ = W##_set1_epi32(127);                         \
        const VI n1_ = W##_srai_epi32(ni_, 1), n2_ = W##_sub_epi32(ni_, n1_);                  \
        y = W##_mul_ps(W##_mul_ps(p, W##_cast##SI##_ps(W##_slli_epi32(W##_add_epi32(n1_, bias_), 23))), \
                       W##_cast##SI##_ps(W##_slli_epi32(W##_add_epi32(n2_, bias_), 23)));     \
    } while (0)

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* exp_ps (below) on 8 lanes by AVX2 instructions: the same operations in the same order, so the
   same bits. Under SIMDe its scalef (HFD_EXP_SCALE says how) and roundscale were ~4% of a
   one-thread SmolLM2 W4A8 decode step at the avx2 tier (2026-11-27). */
static inline __m256 hfd_exp8_ps(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.7228f), lo = _mm256_set1_ps(-103.9721f);
    const __m256 over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 p, y;
    HFD_EXP_POLY(_mm256, __m256, x, n, p);
    HFD_EXP_SCALE(_mm256, __m256i, si256, p, n, y);
    return _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), over);
}
#endif

/* e^x to about 1 ulp of fp32 (Cody-Waite reduction by ln 2, degree-6 polynomial on
   [-ln2/2, ln2/2]); overflows to inf past 88.72 and underflows to 0 below -87.3 like expf.
   A NaN gives e^88.7228 (the clamp's min returns its second operand), on every tier. */
static inline __m512 exp_ps(__m512 x) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    __m256 h[2];
    memcpy(h, &x, 64);
    h[0] = hfd_exp8_ps(h[0]);
    h[1] = hfd_exp8_ps(h[1]);
    __m512 y;
    memcpy(&y, h, 64);
    return y;
#else
    const __m512 hi = _mm512_set1_ps(88.7228f), lo = _mm512_set1_ps(-103.9721f);
    __m512 big = _mm512_set1_ps(INFINITY);
    __mmask16 over = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ);
    x = _mm512_max_ps(_mm512_min_ps(x, hi), lo);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 p, y;
    HFD_EXP_POLY(_mm512, __m512, x, n, p);
#if defined(__AVX512F__)
    /* p * 2^n, with scalef handling the exponent range (subnormal results included) */
    y = _mm512_scalef_ps(p, n);
#else /* the generic tier (SIMDe) */
    HFD_EXP_SCALE(_mm512, __m512i, si512, p, n, y);
#endif
    return _mm512_mask_mov_ps(y, over, big);
#endif
}

/* a[c] = bf16(bf16(silu(bf16(g[c]))) * bf16(u[c])) for c < cols, 16 lanes at a time. */
static inline void gated_silu_row(const float *g, const float *u, uint16_t *a, int64_t cols) {
    for (int64_t c = 0; c < cols; c += 16) {
        __mmask16 mk = mask16(cols - c);
        __m512 gs = bf16_round(_mm512_maskz_loadu_ps(mk, g + c));
        __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gs));
        __m512 s = bf16_round(_mm512_div_ps(gs, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
        __m512 us = bf16_round(_mm512_maskz_loadu_ps(mk, u + c));
        store16_bf16(a + c, mk, _mm512_mul_ps(s, us));
    }
}

/* y[c] = bf16(o[c]) for c < cols. */
static inline void round_row(const float *o, uint16_t *y, int64_t cols) {
    for (int64_t c = 0; c < cols; c += 16) {
        __mmask16 mk = mask16(cols - c);
        store16_bf16(y + c, mk, _mm512_maskz_loadu_ps(mk, o + c));
    }
}

/* ---- int8 weights times x in three byte planes (see cpu_quant.c for the numerics) ---- */

#define INT8_ROWS TILE_ROWS /* weight rows streamed together by one thread */

/* One row of x (K elements of dtype dt, times in_scale when given) as 24-bit fixed point
   relative to its absmax: v[k] = round(x[k] * (2^23 - 1) / absmax), |v| <= 2^23 - 1, as kp int32
   (K rounded up to 64; columns past K are 0) in the kp floats of scratch xf. Returns the value
   of one unit. */
static inline double int8_fixed(const void *x, int dt, const float *in_scale, int64_t K,
                                int64_t kp, float *xf) {
    __m512 vmax = _mm512_setzero_ps();
    for (int64_t k = 0; k < kp; k += 16) {
        __mmask16 mk = mask16(K - k);
        __m512 v = load16(x, k, dt, mk);
        if (in_scale) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mk, in_scale + k));
        _mm512_store_ps(xf + k, v);
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
    }
    float amax = _mm512_reduce_max_ps(vmax);
    /* x * fx rounds to an integer in [-(2^23 - 1), 2^23 - 1] */
    float fx = amax > 0.f ? 8388607.0f / amax : 0.f;
    const __m512 vfx = _mm512_set1_ps(fx);
    const __m512i lim = _mm512_set1_epi32(8388607); /* fp32 rounding may reach 2^23 */
    for (int64_t k = 0; k < kp; k += 16) {
        __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(xf + k), vfx));
        i = _mm512_max_epi32(_mm512_min_epi32(i, lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
        _mm512_store_si512((__m512i *)(xf + k), i);
    }
    return amax > 0.f ? (double)amax / 8388607.0 : 0.0;
}

/* int8_fixed's v offset to unsigned (v + 2^23) and split into byte planes p0 | p1 | p2 of kp
   bytes each; xf: kp floats of scratch. Returns the value of one unit. */
static inline double int8_planes(const void *x, int dt, const float *in_scale, int64_t K,
                                 int64_t kp, float *xf, uint8_t *p0) {
    const double unit = int8_fixed(x, dt, in_scale, K, kp, xf);
    uint8_t *p1 = p0 + kp, *p2 = p1 + kp;
    const __m512i offset = _mm512_set1_epi32(8388608), byte = _mm512_set1_epi32(255);
    for (int64_t k = 0; k < kp; k += 16) {
        __m512i u = _mm512_add_epi32(_mm512_load_si512((const __m512i *)(xf + k)), offset);
        if (k + 16 > K) /* columns past K are 0 in every plane, so they add nothing */
            u = _mm512_maskz_mov_epi32(mask16(K - k), u);
        _mm_store_si128((__m128i *)(p0 + k), _mm512_cvtepi32_epi8(_mm512_and_si512(u, byte)));
        _mm_store_si128((__m128i *)(p1 + k), _mm512_cvtepi32_epi8(_mm512_and_si512(_mm512_srli_epi32(u, 8), byte)));
        _mm_store_si128((__m128i *)(p2 + k), _mm512_cvtepi32_epi8(_mm512_srli_epi32(u, 16)));
    }
    return unit;
}

/* The int8 kernels' own loops on AVX2 (no 512-bit vectors, no VNNI): hfd_avx2.h. */
#include "hfd_avx2.h"

/* x as the int8 dot products of this tier read it (int8_dots), in INT8_X_BYTES(kp) bytes at p:
   byte planes (int8_planes), or on AVX2 int16 planes (hfd_avx2.h: int8_planes16). Returns the
   value of one unit. */
static inline double int8_input(const void *x, int dt, const float *in_scale, int64_t K,
                                int64_t kp, float *xf, uint8_t *p) {
#if HFD_AVX2_DOTS
    return int8_planes16(x, dt, in_scale, K, kp, xf, p);
#else
    return int8_planes(x, dt, in_scale, K, kp, xf, p);
#endif
}

/* s[r] = sum_k xq[k] * q[r, k] exactly, for the INT8_ROWS weight rows wr (K int8 each) and the
   fixed-point x as int8_input stored it at p0: byte planes kp bytes apart, xq = plane value -
   2^23 (rowsum: the rows' sums of q); on AVX2 int16 planes (hfd_avx2.h: int8_dots_avx2).
   Multiply by the unit of int8_input and the row scale to get the dot product.
   Row-major rows (tiled 0): next (or NULL), end: the INT8_ROWS * K contiguous bytes the caller
   reads next, see prefetch_next_block (a 5632 x 2048 stream: 23.6-24.2 GB/s before, 24.2-25.0
   with it). Tiles (tiled 1, wr[r] = tile_row(...)): the stream is prefetched ahead
   (prefetch_tiles) up to end (NULL: not at all), and next is unused. */
static inline __attribute__((always_inline)) void int8_dots(
        const int8_t *const *wr, const int32_t *rowsum, int rows, const uint8_t *p0, int64_t kp,
        int64_t K, int64_t *s, const int8_t *next, const int8_t *end, int tiled) {
#if HFD_AVX2_DOTS
    (void)rowsum; /* int16 planes of x itself: no offset to remove */
    int8_dots_avx2(wr, rows, p0, kp, K, s, next, end, tiled);
#else
    const uint8_t *p1 = p0 + kp, *p2 = p1 + kp;
    const int64_t step = tiled ? INT8_ROWS : 1; /* bytes of a row's stream per column */
    int64_t tail = K % 64;
    __mmask64 tail_mask = tail ? (((__mmask64)1 << tail) - 1) : 0;
    __m512i a0[INT8_ROWS], a1[INT8_ROWS], a2[INT8_ROWS];
    for (int r = 0; r < INT8_ROWS; r++) a0[r] = a1[r] = a2[r] = _mm512_setzero_si512();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        __m512i x0 = _mm512_load_si512(p0 + k), x1 = _mm512_load_si512(p1 + k);
        __m512i x2 = _mm512_load_si512(p2 + k);
        if (tiled) {
            if (end) prefetch_tiles(wr[0] + k * step, end);
        } else {
            prefetch_next_block(next, end, k / 64 * INT8_ROWS, INT8_ROWS, 0);
        }
        for (int r = 0; r < INT8_ROWS; r++) {
            __m512i w = _mm512_loadu_si512(wr[r] + k * step);
            a0[r] = _mm512_dpbusd_epi32(a0[r], x0, w);
            a1[r] = _mm512_dpbusd_epi32(a1[r], x1, w);
            a2[r] = _mm512_dpbusd_epi32(a2[r], x2, w);
        }
    }
    if (tail) { /* row-major only: tiles hold whole 64-column chunks */
        __m512i x0 = _mm512_load_si512(p0 + k), x1 = _mm512_load_si512(p1 + k);
        __m512i x2 = _mm512_load_si512(p2 + k);
        for (int r = 0; r < INT8_ROWS; r++) {
            __m512i w = _mm512_maskz_loadu_epi8(tail_mask, wr[r] + k);
            a0[r] = _mm512_dpbusd_epi32(a0[r], x0, w);
            a1[r] = _mm512_dpbusd_epi32(a1[r], x1, w);
            a2[r] = _mm512_dpbusd_epi32(a2[r], x2, w);
        }
    }
    for (int r = 0; r < rows; r++)
        /* |plane sum| <= K * 255 * 127: int32 holds it for K < 66k */
        s[r] = (int64_t)_mm512_reduce_add_epi32(a0[r])
             + 256 * (int64_t)_mm512_reduce_add_epi32(a1[r])
             + 65536 * (int64_t)_mm512_reduce_add_epi32(a2[r])
             - 8388608LL * rowsum[r];
#endif
}

#endif
