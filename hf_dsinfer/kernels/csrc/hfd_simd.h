/* Vector helpers shared by the native CPU kernels (cpu_quant.c, cpu_moe.c, cpu_decode.c), which
 * _native.py compiles together into one library with AVX-512 F/BW/VL/VNNI/BF16.
 *
 * Rounding follows torch: fp32 -> bf16 / fp16 round to nearest even, NaN kept quiet, so a kernel
 * that rounds where a torch op would round reproduces it bit for bit. */
#ifndef HFD_SIMD_H
#define HFD_SIMD_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

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
   (in cpu_decode.c's lin_block) it deleted the calls, and the int4 / int8 rows ran unfetched. */
static inline __attribute__((always_inline)) void prefetch_next_block(const void *next, const void *end, int64_t first,
                                       int lines) {
    if (!next) return;
    for (int i = 0; i < lines; i++) {
        const char *p = (const char *)next + 64 * (first + i);
        if (p < (const char *)end) _mm_prefetch(p, _MM_HINT_T0);
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
static inline __m512i bf16_bits(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
}

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
    _mm256_mask_storeu_epi16(p, mk, _mm512_cvtepi32_epi16(bf16_bits(v)));
}

/* e^x to about 1 ulp of fp32 (Cody-Waite reduction by ln 2, degree-6 polynomial on
   [-ln2/2, ln2/2]); overflows to inf past 88.72 and underflows to 0 below -87.3 like expf. */
static inline __m512 exp_ps(__m512 x) {
    const __m512 hi = _mm512_set1_ps(88.7228f), lo = _mm512_set1_ps(-103.9721f);
    __m512 big = _mm512_set1_ps(INFINITY);
    __mmask16 over = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ);
    x = _mm512_max_ps(_mm512_min_ps(x, hi), lo);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    /* p * 2^n, with scalef handling the exponent range (subnormal results included) */
    __m512 y = _mm512_scalef_ps(p, n);
    return _mm512_mask_mov_ps(y, over, big);
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
   relative to its absmax, offset to unsigned and split into byte planes p0 | p1 | p2 of kp
   (K rounded up to 64) bytes each; xf: kp floats of scratch. Returns the value of one unit. */
static inline double int8_planes(const void *x, int dt, const float *in_scale, int64_t K,
                                 int64_t kp, float *xf, uint8_t *p0) {
    __m512 vmax = _mm512_setzero_ps();
    for (int64_t k = 0; k < kp; k += 16) {
        __mmask16 mk = mask16(K - k);
        __m512 v = load16(x, k, dt, mk);
        if (in_scale) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mk, in_scale + k));
        _mm512_store_ps(xf + k, v);
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
    }
    float amax = _mm512_reduce_max_ps(vmax);
    /* x * fx rounds to an integer in [-(2^23 - 1), 2^23 - 1]; + 2^23 makes it unsigned */
    float fx = amax > 0.f ? 8388607.0f / amax : 0.f;
    uint8_t *p1 = p0 + kp, *p2 = p1 + kp;
    const __m512 vfx = _mm512_set1_ps(fx);
    const __m512i offset = _mm512_set1_epi32(8388608), byte = _mm512_set1_epi32(255);
    const __m512i lim = _mm512_set1_epi32(8388607); /* fp32 rounding may reach 2^23 */
    for (int64_t k = 0; k < kp; k += 16) {
        __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(xf + k), vfx));
        i = _mm512_max_epi32(_mm512_min_epi32(i, lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
        __m512i u = _mm512_add_epi32(i, offset);
        if (k + 16 > K) /* columns past K are 0 in every plane, so they add nothing */
            u = _mm512_maskz_mov_epi32(mask16(K - k), u);
        _mm_store_si128((__m128i *)(p0 + k), _mm512_cvtepi32_epi8(_mm512_and_si512(u, byte)));
        _mm_store_si128((__m128i *)(p1 + k), _mm512_cvtepi32_epi8(_mm512_and_si512(_mm512_srli_epi32(u, 8), byte)));
        _mm_store_si128((__m128i *)(p2 + k), _mm512_cvtepi32_epi8(_mm512_srli_epi32(u, 16)));
    }
    return amax > 0.f ? (double)amax / 8388607.0 : 0.0;
}

/* s[r] = sum_k xq[k] * q[r, k] exactly, for the INT8_ROWS weight rows wr (K int8 each) and the
   fixed-point x in planes p0 (kp bytes apart), where xq = plane value - 2^23 (rowsum: the rows'
   sums of q). Multiply by the unit of int8_planes and the row scale to get the dot product.
   Row-major rows (tiled 0): next (or NULL), end: the INT8_ROWS * K contiguous bytes the caller
   reads next, see prefetch_next_block (a 5632 x 2048 stream: 23.6-24.2 GB/s before, 24.2-25.0
   with it). Tiles (tiled 1, wr[r] = tile_row(...)): the stream is prefetched ahead
   (prefetch_tiles) up to end (NULL: not at all), and next is unused. */
static inline __attribute__((always_inline)) void int8_dots(
        const int8_t *const *wr, const int32_t *rowsum, int rows, const uint8_t *p0, int64_t kp,
        int64_t K, int64_t *s, const int8_t *next, const int8_t *end, int tiled) {
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
            prefetch_next_block(next, end, k / 64 * INT8_ROWS, INT8_ROWS);
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
}

#endif
